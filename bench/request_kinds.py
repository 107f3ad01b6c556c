"""The sweep's request kinds: what its requests ask for besides the prompt (plain greedy decoding,
a JSON schema, or penalties). Every kind is greedy with EOS ignored and runs to max_tokens, so the
cells of one arm differ only by what the kind costs (the grammar mask, the penalties' per-row
work) and by what it does to acceptance. A cell of a kind other than plain is named `ARM/KIND`.
(Not `metrale bench --workload`, which picks the sweep or the chat benchmark.)
"""
from __future__ import annotations

from runtime.sample.grammar import StructuredOutput
from runtime.sample.sampler import SamplingParams

# A list of records whose minItems no request reaches: the grammar never completes, so each request
# runs to max_tokens as the plain ones do, always inside the schema.
SYMBOL = {"type": "object", "additionalProperties": False, "required": ["name", "line", "kind"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "line": {"type": "integer", "minimum": 0, "maximum": 9999},
                         "kind": {"enum": ["def", "class", "import", "call"]}}}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["symbols"],
          "properties": {"symbols": {"type": "array", "items": SYMBOL, "minItems": 1000}}}
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
REQUEST_KINDS = ("plain", "json", "penalties")


def request_params(kind: str, max_tokens: int) -> SamplingParams:
    """The sampling parameters of every request of `kind`."""
    if kind == "plain":
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    if kind == "json":
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, structured=StructuredOutput.json_schema(SCHEMA))
    if kind == "penalties":
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **PENALTIES)
    raise ValueError(f"unknown bench request kind {kind!r} (one of {', '.join(REQUEST_KINDS)})")


def cell_name(arm: str, kind: str) -> str:
    return arm if kind == "plain" else f"{arm}/{kind}"
