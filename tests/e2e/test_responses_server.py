"""`POST /v1/responses` on a real server through the openai client's `responses.create`: the
same tokens as the chat request it amounts to, whole and streamed, a JSON schema through
`text.format`, a named function tool, and the stateful fields refused by name."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.xdist_group("responses")

PROMPT = "def main():"


def _chat(client, messages, tokens: int) -> str:
    done = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=tokens, temperature=0
    )
    return done.choices[0].message.content


def test_a_response_is_the_chat_answer_whole_and_streamed(server):
    client = server.client()
    args = dict(model="tiny", input=PROMPT, instructions="Answer.", max_output_tokens=8)
    whole = client.responses.create(**args, temperature=0)
    want = _chat(
        client, [{"role": "system", "content": "Answer."}, {"role": "user", "content": PROMPT}], 8
    )
    assert whole.object == "response" and whole.output_text == want
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 8 and whole.usage.input_tokens > 0
    (item,) = whole.output
    assert item.type == "message" and item.content[0].type == "output_text"
    events = list(client.responses.create(**args, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == want and events[-1].response.output_text == want
    as_list = client.responses.create(
        model="tiny",
        input=[{"role": "user", "content": [{"type": "input_text", "text": PROMPT}]}],
        max_output_tokens=8,
        temperature=0,
    )
    assert as_list.output_text == _chat(client, [{"role": "user", "content": PROMPT}], 8)


def test_text_format_and_a_named_tool_are_chats_constraints(server):
    """`text.format` is chat's response_format and a named function chat's tool_choice: the
    same grammar, so the same tokens as the chat request (the tiny random model fills the
    schema's allowed whitespace)."""
    client = server.client()
    schema = {
        "type": "object",
        "properties": {"pick": {"type": "string", "enum": ["red", "blue"]}},
        "required": ["pick"],
        "additionalProperties": False,
    }
    args = dict(model="tiny", input="Pick one.", max_output_tokens=40, temperature=0)

    def chat(**constraint):
        user = [{"role": "user", "content": "Pick one."}]
        done = client.chat.completions.create(
            model="tiny", messages=user, max_tokens=40, temperature=0, **constraint
        )
        return done.choices[0].message

    done = client.responses.create(
        **args, text={"format": {"type": "json_schema", "name": "pick", "schema": schema}}
    )
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}
    assert done.output_text == chat(response_format=fmt).content and "{" in done.output_text
    tool = {"type": "function", "name": "paint", "parameters": schema}
    called = client.responses.create(
        **args, tools=[tool], tool_choice={"type": "function", "name": "paint"}
    )
    (call,) = [o for o in called.output if o.type == "function_call"]
    want = (
        chat(
            tools=[{"type": "function", "function": {"name": "paint", "parameters": schema}}],
            tool_choice={"type": "function", "function": {"name": "paint"}},
        )
        .tool_calls[0]
        .function
    )
    assert (call.name, call.arguments) == (want.name, want.arguments)


@pytest.mark.parametrize(
    ("field", "value"),
    [("previous_response_id", "resp_1"), ("store", True), ("truncation", "auto")],
)
def test_what_needs_a_stored_response_is_refused_by_name(server, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        server.client().responses.create(model="tiny", input="x", **{field: value})
    assert err.value.body["param"] == field
