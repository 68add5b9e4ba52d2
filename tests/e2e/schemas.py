"""Twenty JSON schemas of the kinds agent frameworks send (nested objects, enums, arrays, bounded
numbers, required fields), each with the question asked for it."""

from __future__ import annotations

from typing import Any


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": required or list(props),
        "additionalProperties": False,
    }


STR = {"type": "string", "maxLength": 40}
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    (
        "Describe a person.",
        _obj({"name": STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    ),
    ("What is the capital of France?", _obj({"city": STR, "country": STR})),
    (
        "Is water wet? Answer with a confidence.",
        _obj(
            {
                "answer": {"type": "boolean"},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            }
        ),
    ),
    ("Pick a primary color.", _obj({"color": {"enum": ["red", "yellow", "blue"]}})),
    (
        "List three fruits.",
        _obj({"fruits": {"type": "array", "items": STR, "minItems": 3, "maxItems": 3}}),
    ),
    (
        "Give a book with its author and year.",
        _obj(
            {
                "title": STR,
                "author": _obj({"first": STR, "last": STR}),
                "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
            }
        ),
    ),
    (
        "Rate a movie from 1 to 5.",
        _obj({"movie": STR, "stars": {"type": "integer", "minimum": 1, "maximum": 5}}),
    ),
    (
        "Convert 10 kilometers to miles.",
        _obj({"km": {"type": "number"}, "miles": {"type": "number"}}),
    ),
    (
        "Describe the weather today.",
        _obj(
            {
                "condition": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
                "temperature_c": {"type": "integer", "minimum": -50, "maximum": 60},
            }
        ),
    ),
    (
        "Make a to-do list with two tasks.",
        _obj(
            {
                "tasks": {
                    "type": "array",
                    "maxItems": 2,
                    "minItems": 2,
                    "items": _obj({"task": STR, "done": {"type": "boolean"}}),
                }
            }
        ),
    ),
    (
        "Give an address.",
        _obj({"street": STR, "city": STR, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    ),
    (
        "Classify the sentiment of: I love this!",
        _obj(
            {
                "sentiment": {"enum": ["positive", "negative", "neutral"]},
                "score": {"type": "number", "minimum": -1, "maximum": 1},
            }
        ),
    ),
    (
        "Name a planet and its moons.",
        _obj({"planet": STR, "moons": {"type": "integer", "minimum": 0, "maximum": 200}}),
    ),
    (
        "Create a user profile.",
        _obj(
            {
                "username": {"type": "string", "pattern": "^[a-z]{3,12}$"},
                "email": STR,
                "roles": {"type": "array", "items": {"enum": ["admin", "user"]}, "maxItems": 2},
            }
        ),
    ),
    (
        "Give a recipe with two ingredients.",
        _obj(
            {
                "dish": STR,
                "ingredients": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 2,
                    "items": _obj(
                        {"item": STR, "grams": {"type": "integer", "minimum": 1, "maximum": 1000}}
                    ),
                },
            }
        ),
    ),
    (
        "What time is it? Use 24-hour time.",
        _obj(
            {
                "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                "minute": {"type": "integer", "minimum": 0, "maximum": 59},
            }
        ),
    ),
    (
        "Describe a car.",
        _obj(
            {
                "make": STR,
                "model": STR,
                "electric": {"type": "boolean"},
                "doors": {"enum": [2, 4, 5]},
            },
            ["make", "electric", "doors"],
        ),
    ),
    (
        "Translate hello to Spanish.",
        _obj({"source": STR, "target": STR, "language": {"const": "es"}}),
    ),
    (
        "Summarize a meeting.",
        _obj(
            {
                "topic": STR,
                "attendees": {"type": "integer", "minimum": 1, "maximum": 50},
                "decisions": {"type": "array", "items": STR, "maxItems": 2},
                "next": _obj(
                    {
                        "date": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"},
                        "owner": STR,
                    }
                ),
            }
        ),
    ),
    (
        "Give a point in 3D.",
        _obj(
            {
                "x": {"type": "number", "minimum": -10, "maximum": 10},
                "y": {"type": "number", "minimum": -10, "maximum": 10},
                "z": {"type": "number", "minimum": -10, "maximum": 10},
            }
        ),
    ),
]
