"""tinker-cookbook's RL recipe `recipes/math_rl` with its `arithmetic` environment, unmodified, trained by an
artlike server: `python -m examples.tinker_cookbook.math_rl --server URL [--steps N]`.

The recipe samples groups of answers to "What is x + y?" on the server's engine, rewards the correct ones,
and trains on them with the `importance_sampling` loss (the recipe's default, `stable_reinforce`, is not
served here). Prints the reward the cookbook logs per step, with its two parts: the fraction of correct
answers and of answers that end with the stop token.
"""

from __future__ import annotations

import asyncio
import tempfile

from tinker_cookbook.recipes.math_rl.train import CLIConfig, cli_main

from .common import RENDERER, arguments, base_model_dir, connect, metrics

REWARD = "env/all/reward/total"


def run(server: str, api_key: str | None, *, model_dir: str | None = None, steps: int = 20,
        groups_per_batch: int = 8, group_size: int = 4, learning_rate: float = 1e-3, rank: int = 8,
        max_tokens: int = 5, log_path: str | None = None) -> list[dict[str, float]]:
    """Run the recipe for `steps` steps; its metrics lines. `max_tokens` is the recipe's own (default 5)."""
    connect(server, api_key)
    log_path = log_path or tempfile.mkdtemp(prefix="cookbook-math-rl-")
    model = base_model_dir(model_dir)
    config = CLIConfig(model_name=model, renderer_name=RENDERER, env="arithmetic", lora_rank=rank,
                       group_size=group_size, groups_per_batch=groups_per_batch, learning_rate=learning_rate,
                       max_tokens=max_tokens, loss_fn="importance_sampling", max_steps=steps, save_every=steps, eval_every=0,
                       log_path=log_path, behavior_if_log_dir_exists="delete")
    asyncio.run(cli_main(config))
    return metrics(log_path)


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--groups-per-batch", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--max-tokens", type=int, default=5,
                        help="tokens per answer (the recipe's default, 5, cuts answers like '62 + 51 = 113')")
    args = parser.parse_args()
    lines = run(args.server, args.api_key, model_dir=args.model_dir, steps=args.steps,
                groups_per_batch=args.groups_per_batch, group_size=args.group_size,
                learning_rate=args.learning_rate, max_tokens=args.max_tokens, log_path=args.log_path)
    print("step  reward  correct  format")
    for line in lines:
        if REWARD in line:
            print(f"{int(line['step']):>4}  {line[REWARD]:6.3f}  {line['env/all/correct']:7.3f}  "
                  f"{line['env/all/format']:6.3f}")


if __name__ == "__main__":
    main()
