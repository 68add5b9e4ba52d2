"""LangChain (langchain-openai, the most used agent framework) against a live SmolLM2 server:
`with_structured_output` by function calling and by JSON schema on three pydantic models, ten
prompts each, returns valid instances (pydantic's schemas say nothing of other keys, so the
server closes them; numbers end after json_bounds.MAX_DIGITS digits), never a length error;
`bind_tools` with LangChain's default tool choice (auto) is accepted with the server's default
parser, and the template without tools gets them in its system message."""

from __future__ import annotations

import pytest

from tests.e2e.test_real_models import chat_bundle, smollm2  # noqa: F401 (a fixture)
from tests.support.server import Server

pytestmark = pytest.mark.full

PEOPLE = [
    "Alice is 30 years old.",
    "Bob turned 45 last week.",
    "My grandmother Rose is 88.",
    "Tom, aged 12, plays chess.",
    "Extract the person: Maria, 27.",
    "John Smith is a 52 year old teacher.",
    "Emma is twenty years old.",
    "Meet Liam, who is 33.",
    "Noah (61) retired.",
    "Olivia is 7.",
]
WEATHER = [
    "It is 21 degrees and sunny in Paris.",
    "Rainy and 12 C in London.",
    "Tokyo: 30 degrees, clear skies.",
    "Berlin is cloudy at 5 degrees.",
    "Sunny Madrid, 28 C.",
    "Oslo has snow, -3 degrees.",
    "Rome is sunny at 24 degrees.",
    "Dublin: rain, 10 degrees.",
    "Cairo is hot and sunny, 35 C.",
    "Seattle is overcast and 14 degrees.",
]
BOOKS = [
    "1984 by George Orwell, published 1949.",
    "Dune, Frank Herbert, 1965.",
    "Pride and Prejudice was written by Jane Austen in 1813.",
    "The Hobbit (Tolkien, 1937).",
    "Brave New World, Aldous Huxley, 1932.",
    "Moby-Dick by Herman Melville, 1851.",
    "Ulysses, James Joyce, 1922.",
    "Emma by Jane Austen came out in 1815.",
    "Dracula, Bram Stoker, 1897.",
    "Frankenstein by Mary Shelley, 1818.",
]


def _models():
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        """A person mentioned in the text."""

        name: str = Field(description="the person's name")
        age: int = Field(description="age in years")

    class Weather(BaseModel):
        """The weather in a city."""

        city: str
        temperature_c: float = Field(description="temperature in degrees Celsius")
        sunny: bool

    class Book(BaseModel):
        """A book."""

        title: str
        author: str
        year: int

    return [(Person, PEOPLE), (Weather, WEATHER), (Book, BOOKS)]


@pytest.fixture(scope="module")
def server(smollm2, session_dir):  # noqa: F811
    """SmolLM2 at context 512, default server flags: the tool-call parser is auto."""
    srv = Server(chat_bundle(session_dir, smollm2), "--served-model-name", "smol")
    yield srv
    srv.stop()


def _chat(server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=f"{server.url}/v1", api_key="none", model="smol", temperature=0, max_tokens=150
    )


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_with_structured_output_returns_instances(server, method):
    llm = _chat(server)
    for model, prompts in _models():
        chain = llm.with_structured_output(model, method=method)
        results = [chain.invoke(p) for p in prompts]  # a length error raises here
        valid = sum(isinstance(r, model) for r in results)
        assert valid >= 9, (model.__name__, results)


def test_bind_tools_with_the_default_tool_choice(server):
    """Auto is accepted (the parser comes from the chat template, hermes for SmolLM2's), and
    the template's lack of tools is said at startup. SmolLM2-135M itself answers in text: it
    was not trained to call tools (docs/serving.md#tool-calls)."""
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return "18 C and sunny"

    reply = _chat(server).bind_tools([get_weather]).invoke("What is the weather in Paris?")
    assert reply.content or reply.tool_calls
    assert "has no tools section" in server.stderr()
