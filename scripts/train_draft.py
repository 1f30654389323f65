"""Distil a small draft from the target: label text with the target, train, save with a model card.

Three resumable phases under ``--work``: the target labels corpus chunks and its own continuations
with its top-k distribution (``teacher/``, one file per shard); the draft trains on them
(``checkpoint.pt`` every ``--checkpoint-every`` steps); the final bf16 weights, config and
``card.json`` go to ``--out``. Rerunning the same command continues where it stopped. Uses CUDA when
present. Held-out documents (``cascade.draft.teacher.HELD_OUT``) are never read.

    python scripts/train_draft.py --work runs/draft --out runs/draft/model [--steps 1200] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict, fields
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from cascade.checkpoint import checkpoint_option
from cascade.draft.architecture import DraftShape, draft_config, initialised_draft, shape_record
from cascade.draft.teacher import HELD_OUT, HIDDEN_SAMPLE, TeacherPlan, label_all, load_shards
from cascade.draft.training import StepMetrics, Trainer, TrainPlan
from cascade.logs import show_logs
from cascade.models import default_model
from cascade.packages import staged

CARD = "card.json"


NUMBER_TYPES = {"int": int, "float": float}


def add_dataclass_options(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """One ``--option`` per int / float field of ``cls``, defaulting to the field's default (a name that
    two plans share, like ``seed``, is one option for both)."""
    group = parser.add_argument_group(title)
    taken = {action.dest for action in parser._actions}
    for field in fields(cls):
        if field.type in NUMBER_TYPES and field.name not in taken:
            group.add_argument(
                f"--{field.name.replace('_', '-')}",
                type=NUMBER_TYPES[field.type],
                default=field.default,
                help=f"{cls.__name__}.{field.name}",
            )


def from_args(cls: type, args: argparse.Namespace):
    return cls(**{field.name: getattr(args, field.name) for field in fields(cls) if hasattr(args, field.name)})


def label(target_dir: Path, teacher_dir: Path, plan: TeacherPlan, device: torch.device) -> None:
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).to(device).eval()
    bar = tqdm(desc="labelling (target top-k)", unit="tok", unit_scale=True)
    label_all(
        target,
        lambda text: tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"],
        teacher_dir,
        plan,
        lambda name, tokens: (bar.update(tokens), bar.set_postfix_str(name)),
    )
    bar.close()


def new_draft(target_dir: Path, teacher_dir: Path, shape: DraftShape, seed: int) -> LlamaForCausalLM:
    target_config = AutoConfig.from_pretrained(target_dir)
    embedding = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).get_input_embeddings().weight
    hidden = torch.load(teacher_dir / HIDDEN_SAMPLE).float()  # [N, D]
    return initialised_draft(draft_config(target_config, shape), embedding.detach(), hidden, seed)


def train(trainer: Trainer) -> StepMetrics | None:
    bar = tqdm(total=trainer.plan.steps, initial=trainer.step, desc="training", unit="step")
    smoothed: dict[str, float] = {}

    def on_step(step: int, metrics: StepMetrics) -> None:
        for key, value in asdict(metrics).items():
            smoothed[key] = value if key not in smoothed else 0.95 * smoothed[key] + 0.05 * value
        bar.update(1)
        bar.set_postfix(
            loss=f"{smoothed['loss']:.3f}", kl=f"{smoothed['kl']:.3f}", agreement=f"{smoothed['agreement']:.3f}"
        )

    trainer.run(on_step)
    bar.close()
    return StepMetrics(**smoothed) if smoothed else None


def save(draft: LlamaForCausalLM, target_dir: Path, out: Path, card: dict) -> None:
    """bf16 safetensors + config + the target's tokenizer + card, written to a temporary directory first."""
    with staged(out) as staging:
        draft.to(torch.bfloat16).save_pretrained(staging)
        AutoTokenizer.from_pretrained(target_dir).save_pretrained(staging)
        (staging / CARD).write_text(json.dumps(card, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--work", type=Path, required=True, help="labels and checkpoints (resumable)")
    parser.add_argument("--out", type=Path, required=True, help="where the trained draft is saved")
    parser.add_argument(
        "--target",
        type=checkpoint_option,
        help="target checkpoint: name or directory (default: the provisioned SmolLM2)",
    )
    add_dataclass_options(parser, TeacherPlan, "labelling")
    add_dataclass_options(parser, TrainPlan, "training")
    add_dataclass_options(parser, DraftShape, "architecture")
    args = parser.parse_args()
    show_logs()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target_dir = args.target or default_model("target")
    teacher_plan, train_plan, shape = (from_args(cls, args) for cls in (TeacherPlan, TrainPlan, DraftShape))

    started = time.time()
    label(target_dir, args.work / "teacher", teacher_plan, device)
    data = load_shards(args.work / "teacher")
    print(f"{data['tokens'].numel()} labelled tokens in {len(data['tokens'])} windows")
    draft = new_draft(target_dir, args.work / "teacher", shape, train_plan.seed)
    trainer = Trainer(draft, data, train_plan, args.work / "checkpoint.pt", device)
    final = train(trainer)
    card = {
        "architecture": shape_record(shape, draft.config, AutoConfig.from_pretrained(target_dir)),
        "data": {"plan": asdict(teacher_plan), "labelled_tokens": data["tokens"].numel(), "held_out": HELD_OUT},
        "training": {
            "plan": asdict(train_plan),
            "final_smoothed": asdict(final) if final else None,
            "hardware": torch.cuda.get_device_name()
            if device.type == "cuda"
            else platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "wall_s_this_run": round(time.time() - started),
        },
    }
    save(trainer.draft, target_dir, args.out, card)
    print(f"saved the draft to {args.out}")


if __name__ == "__main__":
    main()
