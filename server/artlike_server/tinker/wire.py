"""The Tinker SDK's protobuf bodies: the forward_backward request in, its output and sampling results out.

Everything else the SDK sends and reads is JSON. Arrays cross as numpy (little-endian on the wire, as the SDK
writes and reads them); the message classes come from `wire_schema`, never from the SDK, which imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from google.protobuf.message import DecodeError

from artlike_server.tinker import wire_schema as schema

PROTOBUF = "application/x-protobuf"

# The dtypes the SDK writes into a request's tensors (its public TensorData has only these two).
_REQUEST_DTYPES: dict[int, np.dtype[Any]] = {
    schema.DTYPE_FLOAT32: np.dtype("<f4"),
    schema.DTYPE_INT64: np.dtype("<i8"),
}
_STOP_REASONS = {"stop": schema.STOP_REASON_STOP, "length": schema.STOP_REASON_LENGTH}


class WireError(ValueError):
    """A body the codec cannot take; the message says what, for the caller."""


@dataclass
class WireDatum:
    """One training example: its input tokens and its loss inputs by name (`target_tokens`, `weights`, ...)."""

    tokens: list[int]
    # float32 or int64; CSR tensors arrive densified (cells not listed are 0); a tensor sent without a shape
    # is 1-D
    loss_fn_inputs: dict[str, npt.NDArray[Any]]


@dataclass
class ForwardBackwardBody:
    """A decoded `POST /api/v1/forward_backward` body."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[WireDatum]


@dataclass
class SampledOutput:
    """One sampled sequence: its tokens, each token's logprob, and why sampling stopped."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]


def decode_forward_backward(body: bytes) -> ForwardBackwardBody:
    """Decode a `tinker_public.ForwardBackwardRequest`; `WireError` names what is wrong with it."""
    request = schema.ForwardBackwardRequest()
    try:
        request.ParseFromString(body)
    except DecodeError as error:
        raise WireError(f"the body is not a tinker_public.ForwardBackwardRequest protobuf: {error}") from error
    return ForwardBackwardBody(
        model_id=request.model_id,
        seq_id=request.seq_id,
        loss_fn=request.loss_fn,
        loss_fn_config=_loss_fn_config(request),
        forward_only=request.forward_only,
        data=[_datum(datum, index) for index, datum in enumerate(request.data)],
    )


def _loss_fn_config(request: Any) -> dict[str, float | str]:
    # The SDK writes numbers to both maps and strings only to v2, so v2 is complete whenever it is set.
    if not request.loss_fn_config_v2:
        return {key: float(value) for key, value in request.loss_fn_config.items()}
    config: dict[str, float | str] = {}
    for key, value in request.loss_fn_config_v2.items():
        kind = value.WhichOneof("value")
        if kind == "number":
            config[key] = float(value.number)
        elif kind == "text":
            config[key] = str(value.text)
        else:
            raise WireError(f"loss_fn_config[{key!r}] has neither a number nor a text value")
    return config


def _datum(datum: Any, index: int) -> WireDatum:
    tokens: list[int] = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            what = "an empty chunk" if kind is None else f"a chunk of type {kind!r}"
            raise WireError(f"data[{index}].model_input has {what}: only encoded_text chunks are supported")
        tokens.extend(_array(chunk.encoded_text.tokens, np.dtype("<i4"), f"data[{index}] tokens").tolist())
    return WireDatum(
        tokens=tokens,
        loss_fn_inputs={
            name: _tensor(tensor, f"data[{index}].loss_fn_inputs[{name!r}]")
            for name, tensor in datum.loss_fn_inputs.items()
        },
    )


def _array(raw: bytes, dtype: np.dtype[Any], what: str) -> npt.NDArray[Any]:
    if len(raw) % dtype.itemsize:
        raise WireError(f"{what}: {len(raw)} bytes is not a whole number of {dtype.itemsize}-byte values")
    return np.frombuffer(raw, dtype=dtype)


def _tensor(tensor: Any, what: str) -> npt.NDArray[Any]:
    dtype = _REQUEST_DTYPES.get(tensor.dtype)
    if dtype is None:
        raise WireError(f"{what}: dtype {_dtype_name(tensor.dtype)} is not supported (float32 or int64)")
    shape = [int(size) for size in tensor.shape]
    if any(size < 0 for size in shape):
        raise WireError(f"{what}: shape {shape} has a negative size")
    if tensor.WhichOneof("encoding") == "sparse_csr":
        return _csr_tensor(tensor.sparse_csr, dtype, shape, what)
    values = _array(tensor.dense, dtype, what)
    if not shape:
        return values.copy()
    if math.prod(shape) != values.size:
        raise WireError(f"{what}: shape {shape} holds {math.prod(shape)} values, the data has {values.size}")
    return values.reshape(shape).copy()


def _csr_tensor(csr: Any, dtype: np.dtype[Any], shape: list[int], what: str) -> npt.NDArray[Any]:
    if len(shape) != 2:
        raise WireError(f"{what}: a sparse CSR tensor needs a 2-D shape, not {shape}")
    rows, columns = shape
    values = _array(csr.values, dtype, f"{what} values")
    row_starts = _array(csr.crow_indices, np.dtype("<i8"), f"{what} crow_indices")
    column_indices = _array(csr.col_indices, np.dtype("<i8"), f"{what} col_indices")
    if (
        row_starts.size != rows + 1
        or row_starts[0] != 0
        or row_starts[-1] != values.size
        or np.any(np.diff(row_starts) < 0)
    ):
        raise WireError(
            f"{what}: crow_indices must be {rows + 1} non-decreasing offsets from 0 to the {values.size} values"
        )
    if column_indices.size != values.size or np.any((column_indices < 0) | (column_indices >= columns)):
        raise WireError(f"{what}: col_indices must be {values.size} column numbers below {columns}")
    dense = np.zeros(shape, dtype=dtype)
    dense[np.repeat(np.arange(rows), np.diff(row_starts)), column_indices] = values
    return dense


def _dtype_name(value: int) -> str:
    names = schema.ENUMS["DType"]
    return names[value] if 0 <= value < len(names) else str(value)


def encode_forward_backward_output(
    logprobs: Sequence[Sequence[float]], metrics: Mapping[str, float], *, output_type: str = "ArrayRecord"
) -> bytes:
    """A `tinker_public.ForwardBackwardOutput`: one float32 "logprobs" array per datum, in request order.

    Every metric key is `name:reduction` (the SDK splits each on its one colon to combine results).
    """
    for key in metrics:
        if key.count(":") != 1:
            raise ValueError(f"metric {key!r} must be named 'name:reduction', e.g. 'loss:sum'")
    arrays = [np.asarray(row, dtype="<f4") for row in logprobs]
    offsets = np.cumsum([0, *(array.nbytes for array in arrays)], dtype="<i8")
    output = schema.ForwardBackwardOutput(loss_fn_output_type=output_type)
    record = output.loss_fn_outputs.add(type_tag=output_type, num_datums=len(arrays))
    field = record.fields["logprobs"]
    field.data = b"".join(array.tobytes() for array in arrays)
    field.offsets = offsets.tobytes()
    field.dtype = schema.DTYPE_FLOAT32  # trailing_shape stays [], each datum's array is (N,)
    for key, value in metrics.items():
        output.metrics[key] = float(value)
    return bytes(output.SerializeToString())


def encode_sample_response(
    sequences: Sequence[SampledOutput], *, prompt_logprobs: Sequence[float | None] | None = None
) -> bytes:
    """A `tinker_public.SampleResponse`: the sequences, each with its logprobs, and the prompt's logprobs.

    `prompt_logprobs` (when asked for) has one entry per prompt token; None, and always the first token,
    which nothing predicts, go out as NaN, the SDK's "not scored".
    """
    response = schema.SampleResponse(prompt_cache_hit_tokens=0)
    for sequence in sequences:
        if len(sequence.logprobs) != len(sequence.tokens):
            raise ValueError(
                f"a sampled sequence has {len(sequence.tokens)} tokens but {len(sequence.logprobs)} logprobs"
            )
        response.sequences.add(
            # "stop" is proto3's default (0, not written); "length" goes out explicitly
            stop_reason=_STOP_REASONS[sequence.stop_reason],
            tokens=np.asarray(sequence.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(sequence.logprobs, dtype="<f4").tobytes(),
        )
    if prompt_logprobs is not None:
        scored = np.array([math.nan if value is None else value for value in prompt_logprobs], dtype="<f4")
        if scored.size:
            scored[0] = math.nan
        response.prompt_logprobs = scored.tobytes()
    return bytes(response.SerializeToString())
