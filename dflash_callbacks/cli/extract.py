"""`dflash-callbacks extract`: cache a target's completions (greedy, or sampled as served) and hidden
states for a task set (`cache.extract`, imported when it runs)."""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path

from ..checks import DTYPE_NAMES
from .usage import UsageError


def parse_layer_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layer-ids takes comma-separated integers like 1,16,31, got {text!r}")


def add_extract_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="local folder of the target model (transformers format)")
    parser.add_argument("--out", required=True, help="cache folder to create, or to finish after an interruption")
    parser.add_argument("--tasks", default="coding10", help="built-in task set (coding10, coding50) or a task YAML file")
    layers = parser.add_mutually_exclusive_group(required=True)
    layers.add_argument("--layer-ids", type=parse_layer_ids, help="target layer ids to cache, e.g. 1,16,31")
    layers.add_argument(
        "--drafter", help="drafter folder or config.json: cache its target_layer_ids and record its block size"
    )
    parser.add_argument("--block-size", type=int, default=None, help="record the block size the cache is made for")
    parser.add_argument("--max-new-tokens", type=int, default=512, help="completion length limit per task")
    parser.add_argument("--device", default="cpu", help="torch device for the target, e.g. cuda or cuda:1")
    parser.add_argument(
        "--dtype", choices=list(DTYPE_NAMES), default="float32", help="dtype the target runs and the cache is stored in"
    )
    parser.add_argument(
        "--no-chat-template", dest="chat_template", action="store_false", help="feed prompts as raw text"
    )
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy completions (default); above 0: sample them as served at this temperature")
    parser.add_argument("--top-p", type=float, default=1.0, help="served top-p of sampled answers, in (0, 1] (1: off)")
    parser.add_argument("--top-k", type=int, default=0, help="served top-k of sampled answers (0: off)")
    parser.add_argument("--samples", type=int, default=1,
                        help="sampled answers per prompt (tasks NAME.s0, NAME.s1, ... when above 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled answers")


def extract_problems(args: argparse.Namespace):
    """(the drafter's config or None, one line per problem of the arguments): everything told without torch,
    the task set read (a name close to a built-in one is named), the sampling settings checked together."""
    from ..cache.sampling import sampling_problems
    from ..cache.tasks import load_tasks
    from ..checks import check_int, problems_of
    from ..model.config import DrafterConfig
    from .score import folder_problems

    target = Path(args.target)
    problems = folder_problems("target", target)
    if not problems and not (target / "config.json").is_file():
        problems.append(f"--target {target} has no config.json: it is not a transformers model folder")
    if Path(args.out).is_file():
        problems.append(f"--out {args.out} is a file: give a folder to create, or an unfinished cache")
    try:
        load_tasks(args.tasks)
    except (OSError, ValueError) as e:
        problems.append(f"--tasks: {e}")
    problems += problems_of(lambda: check_int("--max-new-tokens", args.max_new_tokens, 1),
                            lambda: check_int("--block-size", args.block_size, 2, optional=True))
    if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", args.device):
        problems.append(f"--device must be cpu, cuda, cuda:N or auto; got {args.device!r}")
    problems += sampling_problems(args.temperature, args.top_p, args.top_k, args.samples, args.seed)
    drafter = None
    if args.drafter is not None:
        try:
            drafter = DrafterConfig.from_file(args.drafter)
        except (OSError, ValueError) as e:
            problems.append(f"--drafter: {e}")
    return drafter, problems


def run_extract(args: argparse.Namespace) -> int:
    """Run `extract` from parsed arguments (errors raise; `dflash-callbacks` prints them as one line): every
    argument checked, all at once, before torch loads."""
    drafter, problems = extract_problems(args)
    if problems:
        raise UsageError("\n".join(problems))
    from transformers import AutoConfig

    from ..cache.extract import extract_cache
    from ..checks import DTYPES, check_device

    logging.basicConfig(level=logging.INFO, format="%(message)s")  # progress lines; a no-op if logging is set up
    check_device("--device", args.device)
    layer_ids, block_size = args.layer_ids, args.block_size
    if drafter is not None:
        layer_ids = drafter.target_layer_ids
        block_size = block_size if block_size is not None else drafter.block_size
        target = AutoConfig.from_pretrained(args.target, local_files_only=True).get_text_config()
        if (target.hidden_size, target.vocab_size) != (drafter.hidden_size, drafter.vocab_size):
            raise ValueError(
                f"target hidden size {target.hidden_size} / vocab size {target.vocab_size} != drafter "
                f"hidden_size {drafter.hidden_size} / vocab_size {drafter.vocab_size}: this drafter is for another target"
            )
    cache = extract_cache(
        args.target,
        args.out,
        args.tasks,
        layer_ids,
        max_new_tokens=args.max_new_tokens,
        device=args.device,
        dtype=DTYPES[args.dtype],
        chat_template=args.chat_template,
        block_size=block_size,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        samples=args.samples,
        seed=args.seed,
    )
    print(f"cache {cache.path}: {len(cache)} tasks, layer ids {cache.layer_ids}, fingerprint {cache.fingerprint}")
    return 0
