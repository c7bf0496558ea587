"""The Tinker API's protobuf codec (`artlike_server.tinker.wire`) against the `tinker` SDK's own: the schema
equals the SDK's descriptor, requests the SDK encodes decode to the same values, and what the server encodes the
SDK decodes to the values sent. (The test may import the SDK, and torch with it; the server never does.)"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import tinker.types as tinker_types
import torch
from artlike_server.tinker import wire_schema
from artlike_server.tinker.wire import (
    SampledOutput,
    WireError,
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_response,
)
from google.protobuf import descriptor_pb2
from tinker.proto import tinker_public_pb2 as sdk_pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

# Sampling requests are JSON, so their messages are not declared.
SDK_MESSAGES_LEFT_OUT = {"SamplingParams", "StopStrings", "StopTokens"}


def sdk_file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    sdk_pb.DESCRIPTOR.CopyToProto(proto)
    return proto


def test_the_schema_equals_the_sdk_descriptor_message_by_message() -> None:
    sdk, ours = sdk_file_descriptor(), wire_schema.file_descriptor_proto()
    assert (ours.name, ours.package, ours.syntax) == (sdk.name, sdk.package, sdk.syntax)
    assert not sdk.HasField("options") and not sdk.dependency
    sdk_messages = {message.name: message for message in sdk.message_type}
    assert {message.name for message in ours.message_type} == set(sdk_messages) - SDK_MESSAGES_LEFT_OUT
    for message in ours.message_type:
        # DescriptorProto equality: names, numbers, labels, types, type names, oneofs, proto3 presence and the
        # map-entry nested types with their options
        assert message == sdk_messages[message.name], message.name
    assert list(ours.enum_type) == list(sdk.enum_type)


def sdk_request_body(data: list[tinker_types.Datum], loss_fn: str, config: dict[str, float | str] | None) -> bytes:
    request = tinker_types.ForwardBackwardRequest(
        forward_backward_input=tinker_types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="s:train:0",
        seq_id=7,
    )
    return bytes(forward_backward_request_to_proto(request).SerializeToString())


def test_a_request_the_sdk_encodes_decodes_to_the_same_tokens_arrays_and_config() -> None:
    # 2-D target_tokens mostly 0: the SDK sends it as CSR
    sparse_targets = torch.zeros((4, 3), dtype=torch.int64)
    sparse_targets[1, 2] = 9
    sparse_targets[3, 0] = 5
    rl_datum = tinker_types.Datum(
        model_input=tinker_types.ModelInput(
            chunks=[tinker_types.EncodedTextChunk(tokens=[1, 2]), tinker_types.EncodedTextChunk(tokens=[3, 151645])]
        ),
        loss_fn_inputs={
            "target_tokens": sparse_targets,
            "logprobs": [-0.5, -1.25, -2.0, -0.125],
            "advantages": tinker_types.TensorData(data=[1.0, 1.0, -1.0, 0.0], dtype="float32"),  # no shape
        },
    )
    assert rl_datum.loss_fn_inputs["target_tokens"].sparse_crow_indices is not None
    sl_datum = tinker_types.Datum(
        model_input=tinker_types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": np.array([6, 7, 8]), "weights": torch.tensor([0.0, 1.0, 1.0])},
    )
    config: dict[str, float | str] = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "loss_id": "abc"}
    body = decode_forward_backward(sdk_request_body([rl_datum, sl_datum], "ppo", config))

    assert (body.model_id, body.seq_id, body.loss_fn, body.forward_only) == ("s:train:0", 7, "ppo", False)
    assert body.loss_fn_config == config
    assert [datum.tokens for datum in body.data] == [[1, 2, 3, 151645], [5, 6, 7]]
    for ours, sent in zip(body.data, [rl_datum, sl_datum], strict=True):
        assert set(ours.loss_fn_inputs) == set(sent.loss_fn_inputs)
        for name, array in ours.loss_fn_inputs.items():
            expected = sent.loss_fn_inputs[name].to_numpy()
            assert array.dtype == expected.dtype and array.shape == expected.shape, name
            np.testing.assert_array_equal(array, expected)
    assert body.data[0].loss_fn_inputs["target_tokens"].dtype == np.int64
    assert body.data[0].loss_fn_inputs["advantages"].shape == (4,)


def test_numbers_only_config_and_forward_only_decode() -> None:
    request = tinker_types.ForwardBackwardRequest(
        forward_backward_input=tinker_types.ForwardBackwardInput(
            data=[], loss_fn="cross_entropy", loss_fn_config={"beta": 2}
        ),
        model_id="m",
        seq_id=1,
    )
    message = forward_backward_request_to_proto(request)
    message.forward_only = True
    body = decode_forward_backward(message.SerializeToString())
    assert (body.loss_fn_config, body.forward_only, body.data) == ({"beta": 2.0}, True, [])
    # an older client writes only the double map
    message.ClearField("loss_fn_config_v2")
    assert decode_forward_backward(message.SerializeToString()).loss_fn_config == {"beta": 2.0}


def test_the_sdk_decodes_our_forward_backward_output() -> None:
    logprobs = [[-0.5, -1.5, -2.25], [], [-0.125]]
    metrics = {"loss:sum": 4.375, "tokens:sum": 4.0}
    output = deserialize_forward_backward_output(encode_forward_backward_output(logprobs, metrics))
    assert output.loss_fn_output_type == "ArrayRecord"
    assert output.metrics == metrics
    assert len(output.loss_fn_outputs) == 3
    for sent, received in zip(logprobs, output.loss_fn_outputs, strict=True):
        assert set(received) == {"logprobs"}
        tensor = received["logprobs"]
        assert (tensor.dtype, tensor.shape) == ("float32", [len(sent)])
        assert tensor.tolist() == sent


def test_a_metric_key_without_its_reduction_is_refused() -> None:
    with pytest.raises(ValueError, match="name:reduction"):
        encode_forward_backward_output([[0.0]], {"loss": 1.0})


def test_the_sdk_decodes_our_sample_response() -> None:
    sequences = [
        SampledOutput(tokens=[11, 151645], logprobs=[-0.25, -0.5], stop_reason="stop"),
        SampledOutput(tokens=[12, 13, 14], logprobs=[-1.0, -2.0, -3.0], stop_reason="length"),
    ]
    response = deserialize_sample_response(
        encode_sample_response(sequences, prompt_logprobs=[-9.0, -0.75, None, -1.5])
    )
    assert [s.stop_reason for s in response.sequences] == ["stop", "length"]
    assert [s.tokens for s in response.sequences] == [[11, 151645], [12, 13, 14]]
    assert [s.logprobs for s in response.sequences] == [[-0.25, -0.5], [-1.0, -2.0, -3.0]]
    # the first prompt token is never scored, whatever the caller passed
    assert response.prompt_logprobs == [None, -0.75, None, -1.5]
    assert response.prompt_cache_hit_tokens == 0

    plain = deserialize_sample_response(encode_sample_response(sequences[:1]))
    assert plain.prompt_logprobs is None
    assert deserialize_sample_response(encode_sample_response([], prompt_logprobs=[None])).prompt_logprobs == [None]


def test_garbage_and_image_chunks_are_wire_errors() -> None:
    with pytest.raises(WireError, match=r"not a tinker_public\.ForwardBackwardRequest"):
        decode_forward_backward(b"\xff\xff\xff\xff")
    image_datum = tinker_types.Datum(
        model_input=tinker_types.ModelInput(chunks=[tinker_types.ImageChunk(data=b"\x89PNG", format="png")]),
        loss_fn_inputs={"target_tokens": [1], "weights": [1.0]},
    )
    with pytest.raises(WireError, match=r"data\[0\].model_input has a chunk of type 'image'"):
        decode_forward_backward(sdk_request_body([image_datum], "cross_entropy", None))


def test_bad_tensors_are_wire_errors() -> None:
    def body_with(tensor: sdk_pb.Tensor) -> bytes:
        message = sdk_pb.ForwardBackwardRequest(model_id="m", loss_fn="cross_entropy")
        datum = message.data.add()
        datum.model_input.add().encoded_text.tokens = np.array([1, 2], "<i4").tobytes()
        datum.loss_fn_inputs["weights"].CopyFrom(tensor)
        return bytes(message.SerializeToString())

    floats = np.array([1.0, 0.0, 1.0], "<f4").tobytes()
    with pytest.raises(WireError, match="DTYPE_BFLOAT16 is not supported"):
        decode_forward_backward(body_with(sdk_pb.Tensor(dtype=sdk_pb.DTYPE_BFLOAT16, dense=floats)))
    with pytest.raises(WireError, match=r"shape \[2, 2\] holds 4 values, the data has 3"):
        decode_forward_backward(body_with(sdk_pb.Tensor(dtype=sdk_pb.DTYPE_FLOAT32, dense=floats, shape=[2, 2])))
    with pytest.raises(WireError, match="not a whole number of 4-byte values"):
        decode_forward_backward(body_with(sdk_pb.Tensor(dtype=sdk_pb.DTYPE_FLOAT32, dense=floats[:5])))
    bad_csr = sdk_pb.SparseCsr(
        values=floats, crow_indices=np.array([0, 1, 3], "<i8").tobytes(), col_indices=np.array([0, 1, 5], "<i8").tobytes()
    )
    with pytest.raises(WireError, match="col_indices must be 3 column numbers below 2"):
        decode_forward_backward(body_with(sdk_pb.Tensor(dtype=sdk_pb.DTYPE_FLOAT32, sparse_csr=bad_csr, shape=[2, 2])))


def test_the_codec_imports_neither_the_sdk_nor_torch() -> None:
    check = "import sys, artlike_server.tinker.wire; print(sorted({'torch', 'tinker'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
