"""`artlike export` on the embedded model, without a server: each format loads with the library its users
load it with, and generates what the step generates (base + adapter through PEFT)."""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from artlike_server.app import create_app
from artlike_server.errors import Conflict, InvalidRequest, NotFound
from artlike_server.export.__main__ import main as export_main
from artlike_server.export.formats import export_request
from artlike_server.export.run import export_step
from artlike_server.export.service import API_ERROR_EXIT, ExportService
from artlike_server.export.source import find_step
from huggingface_hub import ModelCard
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from .export_steps import POLICY, REWARD, REWARD_HEAD, build_data_dir
from .fake_services import fake_services

PROMPT = [{"role": "user", "content": "Name three colours of the rainbow."}]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_data_dir(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def exports(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every export of the policy's latest step, written once for the module."""
    source = find_step(data_dir, POLICY)
    root = tmp_path_factory.mktemp("exports")
    asked = {"peft": ("peft", None, None), "merged": ("merged", "float32", None),
             **{f"gguf-{quant}": ("gguf", None, quant) for quant in ("f32", "f16", "q8_0")}}
    return {key: export_step(source, export_request(*spec), root / key) for key, spec in asked.items()}


def _prompt_ids(tokenizer: Any) -> torch.Tensor:
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return ids["input_ids"]  # type: ignore[no-any-return]


def _greedy(model: Any, ids: torch.Tensor) -> list[int]:
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, ids.shape[1]:].tolist()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def step_reference(data_dir: Path) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """What step 1 generates as the trainer and vLLM see it: the base with the step's adapter (PEFT)."""
    source = find_step(data_dir, POLICY)
    base = AutoModelForCausalLM.from_pretrained(str(source.base_path), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(source.step_dir)).eval()
    ids = _prompt_ids(AutoTokenizer.from_pretrained(str(source.base_path)))
    plain = _greedy(AutoModelForCausalLM.from_pretrained(str(source.base_path), dtype=torch.float32), ids)
    tokens = _greedy(model, ids)
    assert tokens != plain, "the step's adapter must change what the model says, or the checks prove nothing"
    return tokens, ids, _continuation_logprobs(model, ids, tokens)


def _continuation_logprobs(model: Any, ids: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Each token's log-probability in the greedy continuation `tokens` of `ids`."""
    full = torch.cat([ids, torch.tensor([tokens])], dim=1)
    with torch.no_grad():
        logprobs = model(full).logits[0, ids.shape[1] - 1:-1].log_softmax(-1)
    return logprobs.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def test_the_latest_step_is_found_and_unknown_ones_are_refused(data_dir: Path) -> None:
    assert find_step(data_dir, POLICY).step == 1
    assert find_step(data_dir, f"{POLICY}@0").step == 0
    with pytest.raises(NotFound, match="no step 7"):
        find_step(data_dir, f"{POLICY}@7")
    with pytest.raises(NotFound, match="does not exist"):
        find_step(data_dir, "nobody")
    with pytest.raises(InvalidRequest, match="malformed"):
        find_step(data_dir, f"{POLICY}@x")


def test_bad_requests_are_refused_before_any_work(data_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="format must be one of"):
        export_request("onnx")
    with pytest.raises(InvalidRequest, match="not supported") as error:
        export_request("gguf", quant="q4_k_m")
    assert error.value.code == "unsupported_quantization"
    with pytest.raises(InvalidRequest, match="merged format only"):
        export_request("gguf", dtype="float16")
    with pytest.raises(InvalidRequest, match="gguf format only"):
        export_request("merged", quant="q8_0")
    with pytest.raises(InvalidRequest, match="reward model"):
        export_step(find_step(data_dir, REWARD), export_request("gguf"), tmp_path / "rm")
    assert not (tmp_path / "rm").exists()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    with pytest.raises(Conflict, match="not an empty directory"):
        export_step(find_step(data_dir, POLICY), export_request("peft"), taken)
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]  # no staging directory left beside it


def test_the_peft_export_is_the_adapter_with_the_real_base_id(data_dir: Path, exports: dict[str, Path]) -> None:
    source = find_step(data_dir, POLICY)
    out = exports["peft"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    weights, exported = load_file(source.step_dir / "adapter_model.safetensors"), load_file(out / "adapter_model.safetensors")
    assert weights.keys() == exported.keys() and all(torch.equal(weights[k], exported[k]) for k in weights)
    base = AutoModelForCausalLM.from_pretrained(str(source.base_path), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(out))
    key = next(k for k in weights if "lora_B" in k)
    assert torch.equal(dict(loaded.named_parameters())[key.replace(".weight", ".default.weight")], weights[key])


def test_the_merged_export_generates_what_the_step_generates(
        exports: dict[str, Path], step_reference: tuple[list[int], torch.Tensor, torch.Tensor]) -> None:
    out = exports["merged"]
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "chat_template.jinja", "README.md"} <= {p.name for p in out.iterdir()}
    tokens, ids, _ = step_reference
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.dtype == torch.float32
    assert _greedy(model, ids) == tokens
    assert torch.equal(_prompt_ids(AutoTokenizer.from_pretrained(str(out))), ids)


@pytest.mark.parametrize("quant", ["f32", "f16"])
def test_the_gguf_export_loads_with_transformers_and_generates_the_same_tokens(
        quant: str, exports: dict[str, Path], step_reference: tuple[list[int], torch.Tensor, torch.Tensor]) -> None:
    # f16 rounds each weight to 11 significant bits; on this model and prompt the greedy tokens stay identical.
    out = exports[f"gguf-{quant}"]
    (gguf_file,) = [p.name for p in out.glob("*.gguf")]
    tokens, ids, _ = step_reference
    if quant == "f32":  # the metadata is the same in every GGUF export: its tokenizer is checked once
        tokenizer = AutoTokenizer.from_pretrained(str(out), gguf_file=gguf_file)
        assert torch.equal(_prompt_ids(tokenizer), ids), "the tokenizer and chat template in the GGUF metadata"
    model = AutoModelForCausalLM.from_pretrained(str(out), gguf_file=gguf_file, dtype=torch.float32)
    assert _greedy(model, ids) == tokens


def test_the_q8_0_gguf_export_stays_close_to_the_step(
        exports: dict[str, Path], step_reference: tuple[list[int], torch.Tensor, torch.Tensor]) -> None:
    # Tolerance: 8-bit blocks move each next-token log-probability by a little; the greedy text agrees on its
    # first 8 tokens, and on the reference's own continuation no token's log-probability is off by more than 0.5.
    out = exports["gguf-q8_0"]
    (gguf_file,) = [p.name for p in out.glob("*.gguf")]
    tokens, ids, reference = step_reference
    model = AutoModelForCausalLM.from_pretrained(str(out), gguf_file=gguf_file, dtype=torch.float32)
    assert _greedy(model, ids)[:8] == tokens[:8]
    assert (_continuation_logprobs(model, ids, tokens) - reference).abs().max().item() < 0.5


def test_every_export_carries_a_model_card(exports: dict[str, Path]) -> None:
    for key, out in exports.items():
        card = ModelCard.load(out / "README.md")
        assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
        assert card.data.library_name == {"peft": "peft", "merged": "transformers"}.get(key, "gguf")
        assert card.data.artlike["step"] == 1 and card.data.artlike["model"] == POLICY
        assert "| 1 | 0.5 | 0.25 | 0.01 | 8 |" in card.text
        assert "held_out: accuracy = 0.8" in card.text


def test_a_reward_model_exports_as_sequence_classification(data_dir: Path, tmp_path: Path) -> None:
    source = find_step(data_dir, REWARD)
    out = export_step(source, export_request("merged", dtype="float32"), tmp_path / "rm")
    model = AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
    head = load_file(source.step_dir / "adapter_model.safetensors")["base_model.model.score.weight"]
    assert torch.equal(model.score.weight, head)
    assert list(model.config.id2label.values()) == REWARD_HEAD.names
    assert ModelCard.load(out / "README.md").data.pipeline_tag == "text-classification"
    # The same scores as the step through PEFT (the trainer's scorer: the score head on the last token).
    base = AutoModelForSequenceClassification.from_pretrained(str(source.base_path), num_labels=2, dtype=torch.float32)
    reference = PeftModel.from_pretrained(base, str(source.step_dir)).eval()
    ids = _prompt_ids(AutoTokenizer.from_pretrained(str(out)))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, reference(ids).logits, atol=1e-4)


@pytest.fixture
async def http(data_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    source = find_step(data_dir, POLICY)
    app = create_app(fake_services(exports=ExportService(data_dir, source.base_path)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as client:
        yield client


async def test_the_http_route_streams_the_cli_export_as_a_tar(
        http: httpx.AsyncClient, exports: dict[str, Path]) -> None:
    response = await http.get(f"/v1/trainable_models/{POLICY}/steps/1/export", params={"format": "peft"})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/x-tar"
    assert f'filename="{POLICY}-step1-peft.tar"' in response.headers["content-disposition"]
    with tarfile.open(fileobj=io.BytesIO(response.content)) as archive:
        files = {member.name: archive.extractfile(member).read() for member in archive.getmembers()}  # type: ignore[union-attr]
    expected = {f"{POLICY}-step1-peft/{p.name}": p.read_bytes() for p in exports["peft"].iterdir()}
    assert files == expected


@pytest.mark.parametrize(("path", "params", "status", "code"), [
    (f"{POLICY}/steps/7", {"format": "peft"}, 404, "model_not_found"),
    ("nobody/steps/1", {"format": "peft"}, 404, "model_not_found"),
    (f"{REWARD}/steps/1", {"format": "gguf"}, 400, "unsupported_export"),
    (f"{POLICY}/steps/1", {"format": "gguf", "quant": "q4_k_m"}, 400, "unsupported_quantization"),
    (f"{POLICY}/steps/1", {"format": "tflite"}, 400, "invalid_export_format"),
])
async def test_the_http_route_refuses_bad_requests_in_the_openai_error_shape(
        http: httpx.AsyncClient, path: str, params: dict[str, str], status: int, code: str) -> None:
    response = await http.get(f"/v1/trainable_models/{path}/export", params=params)
    assert response.status_code == status
    assert response.json()["error"]["code"] == code


def test_the_export_process_reports_api_errors_as_json(data_dir: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    # The server's child process: its exit status and stdout are how the route raises the same error.
    assert export_main([str(data_dir), f"{POLICY}@7", "peft", str(tmp_path / "out")]) == API_ERROR_EXIT
    answer = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert answer["status"] == 404 and answer["error"]["code"] == "model_not_found"
    assert export_main([str(data_dir), f"{POLICY}@0", "peft", str(tmp_path / "out")]) == 0
    assert ModelCard.load(tmp_path / "out" / "README.md").data.artlike["step"] == 0
