"""The JSON schema the constrained-decoding tests compile over their small vocabularies of JSON
pieces: an object of exactly three keys, a boolean, an integer 0 to 99 and one of two strings, so
that a short greedy decode must close it and ``json.loads`` can check what came out."""

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tag": {"enum": ["a", "b"]}},
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}
