"""tinker-cookbook's supervised loop, unmodified, on its own `example_data/conversations.jsonl`, trained by an
artlike server: `python -m examples.tinker_cookbook.sft --server URL [--steps N]`.

Prints the per-step NLL the cookbook logs (falling as the model learns the conversations) and the checkpoint
paths it saved (`tinker://...`), which the server lists as steps of the run's trainable model.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import tinker_cookbook
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

from .common import RENDERER, arguments, base_model_dir, connect, metrics

CONVERSATIONS = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"


def config(model_dir: str, log_path: str, *, steps: int | None, batch_size: int, max_length: int,
           learning_rate: float, rank: int, save_every: int) -> train.Config:
    dataset = FromConversationFileBuilder(
        file_path=str(CONVERSATIONS),
        common_config=ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=model_dir, renderer_name=RENDERER,
                                                     max_length=max_length, batch_size=batch_size))
    return train.Config(log_path=log_path, model_name=model_dir, recipe_name="sft_example", renderer_name=RENDERER,
                        dataset_builder=dataset, learning_rate=learning_rate, lora_rank=rank, max_steps=steps,
                        save_every=save_every, eval_every=0)


def run(server: str, api_key: str | None, *, model_dir: str | None = None, steps: int | None = None,
        batch_size: int = 8, max_length: int = 512, learning_rate: float = 5e-4, rank: int = 8,
        save_every: int = 20, log_path: str | None = None) -> list[dict[str, float]]:
    """Run the loop; its metrics lines."""
    connect(server, api_key)
    log_path = log_path or tempfile.mkdtemp(prefix="cookbook-sft-")
    asyncio.run(train.main(config(base_model_dir(model_dir), log_path, steps=steps, batch_size=batch_size,
                                  max_length=max_length, learning_rate=learning_rate, rank=rank,
                                  save_every=save_every)))
    return metrics(log_path)


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="stop after this many steps (default: one epoch)")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    lines = run(args.server, args.api_key, model_dir=args.model_dir, steps=args.steps, batch_size=args.batch_size,
                log_path=args.log_path)
    print("step  train_mean_nll")
    for line in lines:
        if "train_mean_nll" in line:
            print(f"{int(line['step']):>4}  {line['train_mean_nll']:.4f}")


if __name__ == "__main__":
    main()
