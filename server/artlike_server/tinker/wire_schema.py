"""The Tinker SDK's public protobuf schema (package `tinker_public`), declared here from a readable table.

The SDK ships this schema as generated code inside its own package, and importing that package imports torch,
which the server process never does. So the messages the server reads and writes are built at import time: the
table below becomes a `FileDescriptorProto`, added to a private `DescriptorPool` (never the default one, where
the SDK's own copy may live in the same interpreter), and each message class comes from `GetMessageClass`.
`tests/unit/test_tinker_wire.py` holds it equal, field by field, to the descriptor of the SDK version it pins.

Each field is `(number, name, spec)`; a spec reads like its line in a .proto file:
`TYPE`, `repeated TYPE`, `optional TYPE` (proto3 explicit presence), `oneof GROUP TYPE` or `map<KEY, VALUE>`.
TYPE is a scalar type or a message or enum of this package. The SDK's `SamplingParams`, `StopStrings` and
`StopTokens` are left out: sampling requests arrive as JSON.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "tinker_public"
FILE_NAME = "tinker_public.proto"

_Field = tuple[int, str, str]

# Enum values are numbered from 0 in the order listed.
ENUMS: dict[str, list[str]] = {
    "StopReason": ["STOP_REASON_STOP", "STOP_REASON_LENGTH"],
    "DType": ["DTYPE_UNSPECIFIED", "DTYPE_FLOAT32", "DTYPE_INT64", "DTYPE_INT32", "DTYPE_BFLOAT16"],
}

MESSAGES: dict[str, list[_Field]] = {
    "SampleResponse": [
        (1, "sequences", "repeated SampledSequence"),
        (2, "prompt_logprobs", "optional bytes"),  # float32; NaN where not scored
        (3, "topk_prompt_logprobs", "optional TopkLogprobs"),
        (4, "prompt_cache_hit_tokens", "int32"),
        (5, "target_prompt_logprobs", "optional Tensor"),
        (6, "prompt_alt_tokens", "optional PromptAltTokens"),
    ],
    "PromptAltTokens": [(1, "tokens", "Tensor"), (2, "logprobs", "Tensor")],
    "SampledSequence": [
        (1, "stop_reason", "StopReason"),
        (2, "tokens", "bytes"),  # int32
        (3, "logprobs", "optional bytes"),  # float32
        (4, "topk_sampled_logprobs", "optional TopkLogprobs"),
    ],
    "TopkLogprobs": [(1, "token_ids", "bytes"), (2, "logprobs", "bytes"), (3, "k", "uint32"), (4, "length", "uint32")],
    # CSR: values in the tensor's dtype, both index arrays int64
    "SparseCsr": [(1, "values", "bytes"), (2, "crow_indices", "bytes"), (3, "col_indices", "bytes")],
    "Tensor": [
        (1, "dense", "oneof encoding bytes"),
        (2, "sparse_csr", "oneof encoding SparseCsr"),
        (3, "dtype", "DType"),
        (4, "shape", "repeated int64"),
    ],
    # all datums' arrays back to back; offsets: num_datums + 1 int64 byte offsets into data
    "BatchedTensor": [
        (1, "data", "bytes"),
        (2, "offsets", "bytes"),
        (3, "dtype", "DType"),
        (4, "trailing_shape", "repeated int64"),
    ],
    "ArrayRecord": [
        (1, "type_tag", "string"),
        (2, "fields", "map<string, BatchedTensor>"),
        (3, "num_datums", "int64"),
    ],
    "ForwardBackwardOutput": [
        (1, "loss_fn_output_type", "string"),
        (2, "loss_fn_outputs", "repeated ArrayRecord"),
        (3, "metrics", "map<string, double>"),
    ],
    "ForwardBackwardRequest": [
        (1, "model_id", "string"),
        (2, "seq_id", "int32"),
        (3, "data", "repeated Datum"),
        (4, "loss_fn", "string"),
        (5, "loss_fn_config", "map<string, double>"),
        (6, "forward_only", "bool"),
        (7, "loss_fn_config_v2", "map<string, LossConfigValue>"),
    ],
    "LossConfigValue": [(1, "number", "oneof value double"), (2, "text", "oneof value string")],
    "Datum": [
        (1, "model_input", "repeated Chunk"),
        (2, "loss_fn_inputs", "map<string, Tensor>"),
        (3, "model_input_spans", "repeated ProvenanceSpan"),
        (4, "loss_fn_input_spans", "repeated ProvenanceSpan"),
    ],
    "ProvenanceSpan": [
        (1, "prompt_tokens", "oneof span PromptProvenanceSpan"),
        (2, "sampled_tokens", "oneof span SampledProvenanceSpan"),
    ],
    "PromptProvenanceSpan": [(1, "sequence_id", "string"), (2, "offset", "int64"), (3, "length", "int64")],
    "SampledProvenanceSpan": [(1, "sequence_id", "string"), (2, "offset", "int64"), (3, "length", "int64")],
    "Chunk": [
        (1, "encoded_text", "oneof chunk EncodedTextChunk"),
        (2, "image", "oneof chunk ImageChunk"),
        (3, "dmel", "oneof chunk DmelChunk"),
    ],
    "EncodedTextChunk": [(1, "tokens", "bytes")],  # int32
    "ImageChunk": [
        (1, "data", "bytes"),
        (2, "format", "string"),
        (3, "expected_tokens", "optional int32"),
        (4, "override_dimensions", "optional ImageDimensions"),
    ],
    "ImageDimensions": [(1, "width", "uint32"), (2, "height", "uint32")],
    "DmelChunk": [(1, "dmel", "bytes")],
}

_FDP = descriptor_pb2.FieldDescriptorProto
_SCALARS: dict[str, int] = {
    "bool": _FDP.TYPE_BOOL,
    "bytes": _FDP.TYPE_BYTES,
    "double": _FDP.TYPE_DOUBLE,
    "float": _FDP.TYPE_FLOAT,
    "int32": _FDP.TYPE_INT32,
    "int64": _FDP.TYPE_INT64,
    "string": _FDP.TYPE_STRING,
    "uint32": _FDP.TYPE_UINT32,
    "uint64": _FDP.TYPE_UINT64,
}


def _set_type(field: Any, type_name: str) -> None:
    if type_name in _SCALARS:
        field.type = _SCALARS[type_name]
    elif type_name in ENUMS:
        field.type = _FDP.TYPE_ENUM
        field.type_name = f".{PACKAGE}.{type_name}"
    elif type_name in MESSAGES:
        field.type = _FDP.TYPE_MESSAGE
        field.type_name = f".{PACKAGE}.{type_name}"
    else:
        raise ValueError(f"unknown type {type_name!r} in the Tinker wire schema")


def _map_entry_name(field_name: str) -> str:
    # protoc's rule: CamelCase of the field name plus "Entry" (loss_fn_config_v2 -> LossFnConfigV2Entry)
    return "".join(part[:1].upper() + part[1:] for part in field_name.split("_")) + "Entry"


def _message_proto(name: str, fields: list[_Field]) -> Any:
    message = descriptor_pb2.DescriptorProto(name=name)
    oneof_groups: list[str] = []
    # proto3 `optional` fields each get a synthetic oneof; protoc declares those after the real ones
    synthetic: list[tuple[Any, str]] = []
    for number, field_name, spec in fields:
        field = message.field.add(name=field_name, number=number, label=_FDP.LABEL_OPTIONAL)
        words = spec.split()
        if spec.startswith("map<"):
            key_type, value_type = (part.strip() for part in spec[len("map<") : -1].split(","))
            entry = message.nested_type.add(name=_map_entry_name(field_name))
            entry.options.map_entry = True
            _set_type(entry.field.add(name="key", number=1, label=_FDP.LABEL_OPTIONAL), key_type)
            _set_type(entry.field.add(name="value", number=2, label=_FDP.LABEL_OPTIONAL), value_type)
            field.label = _FDP.LABEL_REPEATED
            field.type = _FDP.TYPE_MESSAGE
            field.type_name = f".{PACKAGE}.{name}.{entry.name}"
        elif words[0] == "repeated":
            field.label = _FDP.LABEL_REPEATED
            _set_type(field, words[1])
        elif words[0] == "optional":
            field.proto3_optional = True
            synthetic.append((field, f"_{field_name}"))
            _set_type(field, words[1])
        elif words[0] == "oneof":
            if words[1] not in oneof_groups:
                oneof_groups.append(words[1])
            field.oneof_index = oneof_groups.index(words[1])
            _set_type(field, words[2])
        else:
            _set_type(field, words[0])
    for group in oneof_groups:
        message.oneof_decl.add(name=group)
    for field, group in synthetic:
        field.oneof_index = len(message.oneof_decl)
        message.oneof_decl.add(name=group)
    return message


def file_descriptor_proto() -> Any:
    """The schema as a `FileDescriptorProto` (what the SDK's generated module embeds, less the omitted messages)."""
    proto = descriptor_pb2.FileDescriptorProto(name=FILE_NAME, package=PACKAGE, syntax="proto3")
    for name, fields in MESSAGES.items():
        proto.message_type.append(_message_proto(name, fields))
    for name, values in ENUMS.items():
        enum = proto.enum_type.add(name=name)
        for number, value in enumerate(values):
            enum.value.add(name=value, number=number)
    return proto


_POOL = descriptor_pool.DescriptorPool()
_POOL.AddSerializedFile(file_descriptor_proto().SerializeToString())


def _message_class(name: str) -> Any:
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))


# The message classes the codec uses (protobuf's classes carry no static field types).
ForwardBackwardRequest: Any = _message_class("ForwardBackwardRequest")
ForwardBackwardOutput: Any = _message_class("ForwardBackwardOutput")
SampleResponse: Any = _message_class("SampleResponse")

DTYPE_FLOAT32 = ENUMS["DType"].index("DTYPE_FLOAT32")
DTYPE_INT64 = ENUMS["DType"].index("DTYPE_INT64")
STOP_REASON_STOP = ENUMS["StopReason"].index("STOP_REASON_STOP")
STOP_REASON_LENGTH = ENUMS["StopReason"].index("STOP_REASON_LENGTH")
