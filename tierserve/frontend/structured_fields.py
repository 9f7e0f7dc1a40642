"""The request fields that name a grammar the output must follow: OpenAI's `response_format`
and vLLM's `structured_outputs` (SGLang's `regex` and `ebnf` are plain strings, in
protocol.py). Each gives at most one StructuredOutput (sampling_params.py)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from tierserve.errors import TierserveError
from tierserve.sampling_params import StructuredOutput


class JsonSchema(BaseModel):
    """OpenAI's `response_format.json_schema`: the schema and its name (strict is implied:
    the output always follows the schema)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    def structured(self) -> StructuredOutput | None:
        if self.type == "json_object":
            return StructuredOutput("json_object")
        if self.type == "json_schema":
            if self.json_schema is None:
                raise TierserveError("json_schema needs its schema", "response_format")
            return StructuredOutput.json(self.json_schema.schema_)
        return None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its StructuredOutputsParams): exactly one constraint.
    JSON is written compact whatever `disable_any_whitespace` says (vLLM's default lets the
    model put whitespace between tokens; both give JSON that follows the schema), and a
    schema's objects take only the properties it names, as with
    `disable_additional_properties`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = Field(None, min_length=1)
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    structural_tag: StrictStr | None = None
    disable_any_whitespace: StrictBool = False
    disable_additional_properties: StrictBool = False
    whitespace_pattern: StrictStr | None = None  # refused: no pattern but JSON's own

    def structured(self) -> StructuredOutput:
        if self.whitespace_pattern is not None:
            raise TierserveError(
                "structured_outputs.whitespace_pattern is not supported", "structured_outputs"
            )
        given = {
            "json": self.json_,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
            "json_object": self.json_object,
            "structural_tag": self.structural_tag,
        }
        named = [k for k, v in given.items() if v is not None]
        if len(named) != 1:
            message = "structured_outputs takes exactly one of " + ", ".join(given)
            raise TierserveError(f"{message}; got {len(named)}", "structured_outputs")
        return _one(named[0], given[named[0]])


def _one(kind: str, value: Any) -> StructuredOutput:
    if kind == "json":
        return StructuredOutput.json(value)
    if kind == "choice":  # one of the strings, exactly: an EBNF of their literals, written
        # as JSON writes them but for characters past the BMP, which a \u escape would write
        # as a surrogate pair that xgrammar reads as two lone halves
        literals = (json.dumps(s, ensure_ascii=False) for s in value)
        return StructuredOutput("ebnf", "root ::= " + " | ".join(literals))
    if kind == "json_object":
        if not value:
            raise TierserveError("structured_outputs.json_object must be true", "json_object")
        return StructuredOutput("json_object")
    if kind == "grammar":  # GBNF's rules are `name ::= ...`, Lark's `name: ...`
        return StructuredOutput("ebnf" if "::=" in value else "lark", value)
    return StructuredOutput(kind, value)
