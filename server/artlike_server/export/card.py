"""The model card every export carries: `README.md` with Hugging Face metadata (so `huggingface-cli upload`
publishes the directory as it is) and a summary of the step's training history from `history.jsonl`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from .formats import ExportRequest
from .source import StepSource

_LIBRARY = {"peft": "peft", "merged": "transformers", "gguf": "gguf"}
_TABLE_COLUMNS = (("reward", "reward mean"), ("loss", "loss mean"), ("kl", "KL mean"))


def write_model_card(directory: Path, source: StepSource, request: ExportRequest) -> None:
    trained = training_lines(source)
    tags = ["artlike", "lora" if request.format == "peft" else request.format]
    if request.format == "gguf":
        tags.append(request.quant)
    data = ModelCardData(
        base_model=source.base_model_id, library_name=_LIBRARY[request.format], tags=tags,
        pipeline_tag="text-classification" if source.kind == "reward" else "text-generation",
        artlike={"model": source.name, "step": source.step, "kind": source.kind, "format": request.format,
                 "trained_steps": len(trained), **_format_detail(request)},
    )
    text = f"---\n{data.to_yaml()}\n---\n\n{_body(source, request, trained)}"
    ModelCard(text).save(directory / "README.md")


def training_lines(source: StepSource) -> list[dict[str, Any]]:
    """The history lines of the trained steps up to this one (alias moves and evaluations left out)."""
    return [line for line in source.history if "event" not in line and isinstance(line.get("step"), int)]


def _format_detail(request: ExportRequest) -> dict[str, str]:
    if request.format == "merged":
        return {"dtype": request.dtype}
    if request.format == "gguf":
        return {"quant": request.quant}
    return {}


def _body(source: StepSource, request: ExportRequest, trained: list[dict[str, Any]]) -> str:
    what = "reward model (sequence classification)" if source.kind == "reward" else "policy"
    lines = [
        f"# {source.name} step {source.step}",
        "",
        f"A {what} trained with artlike as a LoRA adapter (rank {source.lora.rank}, alpha {source.lora.alpha}) "
        f"on `{source.base_model_id}`, exported as `{request.format}`{_detail_text(request)}.",
        "",
        "## Training history",
        "",
    ]
    imported = [line for line in source.history if line.get("event") == "import"]
    if not trained and any(line.get("step") == source.step for line in imported):
        lines.append(f"Step {source.step} is a PEFT adapter trained elsewhere and imported (`artlike import`).")
    elif not trained:
        lines.append(f"Step {source.step} is the untrained adapter (step 0): it behaves as the base model.")
    else:
        lines += ["| step | " + " | ".join(title for _, title in _TABLE_COLUMNS) + " | trajectories |",
                  "|---" * (len(_TABLE_COLUMNS) + 2) + "|"]
        for line in trained:
            cells = [_mean(line.get(key)) for key, _ in _TABLE_COLUMNS]
            lines.append(f"| {line['step']} | " + " | ".join(cells) + f" | {line.get('trajectories', '')} |")
    if trained and imported:
        steps = ", ".join(str(line.get("step")) for line in imported)
        lines += ["", f"Imported steps (PEFT adapters trained elsewhere): {steps}."]
    evaluations = [line for line in source.history if line.get("event") == "eval" and line.get("step") == source.step]
    if evaluations:
        lines += ["", "## Evaluations of this step", ""]
        for line in evaluations:
            scores = ", ".join(f"{key} = {value:g}" for key, value in sorted((line.get("eval") or {}).items())
                               if isinstance(value, (int, float)))
            lines.append(f"- {line.get('split', 'eval')}: {scores}")
    return "\n".join(lines) + "\n"


def _detail_text(request: ExportRequest) -> str:
    detail = _format_detail(request)
    return f" ({', '.join(f'{key} {value}' for key, value in detail.items())})" if detail else ""


def _mean(stats: Any) -> str:
    value = stats.get("mean") if isinstance(stats, dict) else None
    return f"{value:.4g}" if isinstance(value, (int, float)) else ""
