"""Decode and prefill speed of cascade's presets vs transformers' generate() (and its assisted
generation with the same draft) and llama.cpp, side by side.

All run the same checkpoint in the same dtype on the first N tokens of a long document, greedy or
sampled (temperature 0.7, top-p 0.9); beyond the target's native context its rope is stretched with
YaRN. The machine's speed drifts, so the cases are interleaved: each of ``--repeats`` rounds runs
every (implementation, context) case once, each in its own subprocess (load, ``--warmups``
short generations on a shorter prompt, one measured generation), odd rounds in reverse order; where
passes are captured as CUDA graphs the warm-ups make the measured request itself, whose caches and
graphs the measured generation then reuses. A case reports the median over rounds (peak RSS: the
maximum); every ratio to the baseline implementation is taken within each round, then its median
reported, and so is every ratio to each llama.cpp case.

llama.cpp (``llama.cpp``: a bf16 GGUF of the same checkpoint; ``llama.cpp-q8_0``: q8_0, for
reference) is a case like the others, run with llama-bench; before the first round llama.cpp is
built and the GGUFs written (once, under $CASCADE_HOME/peers; see ``cascade.peers``). Its prefill
is prompt processing of the context's length, its decode generation of --new-tokens after that many
tokens in the cache, each with flash attention off and on, the faster reported. llama-bench times
passes over random tokens without sampling, so it generates no text, and --sampling, --dtype and
--prompt-cache do not change it.

Each round first measures the memory bandwidth (a 1 GiB read); every case is priced against the
rate at which that bandwidth streams one target step's bytes (its weights and whole KV at the
context): ``decode_over_step_roofline``. The report goes to ``--out`` or to a new run directory
under ``$CASCADE_HOME/runs/bench/``, with a manifest (command, commit, machine) beside it; it is
rewritten after every case, so a run cut off keeps the cases it measured (``rounds_done`` counts
the whole rounds, ``cases_measured`` the cases).

    python scripts/bench.py [--impls autoregressive self-spec transformers] [--contexts 1024 8000]
        [--new-tokens 64] [--repeats 3] [--sampling greedy sample] [--dtype bfloat16]
    python scripts/bench.py --impls autoregressive self-spec llama.cpp llama.cpp-q8_0 --contexts 1024 8000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from cascade.checkpoint import checkpoint_option, yarn_scaling
from cascade.data import DOCUMENT_NAMES, document_ids
from cascade.errors import CascadeError, entry_point
from cascade.home import prompt_cache_option
from cascade.limits import memory_bandwidth
from cascade.peers.bench_case import flash_attn_summary
from cascade.peers.llama_bench import FLASH_ATTN
from cascade.runs import machine, run_files
from configs.loading import preset_data, preset_names

PRESETS = ("autoregressive", *(name for name in preset_names() if name != "autoregressive"))
PEERS = {"llama.cpp": "bf16", "llama.cpp-q8_0": "q8_0", "llama.cpp-speculative": "bf16"}
"""llama.cpp cases: the GGUF type each runs (``llama.cpp-speculative``: the draft's GGUF proposing
to the target's in llama-speculative at the case's sampling, llama.cpp's default 3 proposals per round)."""
SAMPLING_FREE = {"llama.cpp", "llama.cpp-q8_0"}
"""llama-bench cases: passes over random tokens that sample nothing, so one measurement per round and
context stands for every sampling mode (each costs a prefill of the whole context)."""
IMPLS = (*PRESETS, "transformers", "transformers-assisted", *PEERS)
PEERS_WITH_DRAFTS = {"transformers-assisted", "llama.cpp-speculative"}
WARMUP_TOKENS = 5000  # warm-up prompts are at most this long: first-touch costs without long prefills
WARMUP_NEW_TOKENS = 16  # and generate this many: a few rounds of every pass shape, without a long decode
SAMPLING = {"greedy": {"temperature": 0.0, "top_p": 1.0}, "sample": {"temperature": 0.7, "top_p": 0.9}}
PREDICTION_TOLERANCE = 1.5
"""How far the cost model's predicted speed-up of a preset (``predicted_speedup`` in its stats) may
stray from the one measured against autoregressive decoding in the same round, as a factor either way:
a report lists the cases beyond it (``predictions_off``) and the run warns of them."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python scripts/bench.py", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--impls",
        nargs="+",
        type=impl_option,
        default=["autoregressive", "self-spec", "transformers"],
        metavar="IMPL",
        help=f"what to measure, from {', '.join(IMPLS)}; a preset may carry its own "
        "config overrides, PRESET+KEY=VALUE[+KEY=VALUE] (e.g. self-spec+stages.0.schedule=cost_model, "
        "to compare settings side by side; a draft.path there wins over --draft, e.g. "
        "speculative+draft.path=smollm2-135m-instruct+draft.cross_tokenizer=true); the first is the baseline "
        "of the ratios",
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8000], help="prompt lengths in tokens")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per run")
    parser.add_argument(
        "--repeats", type=int, default=3, help="rounds, each running every case once (medians reported)"
    )
    parser.add_argument(
        "--warmups",
        type=int,
        default=2,
        help="generations before the measured one, per process (on a shorter prompt, except with "
        "--pass-costs carried and where CUDA graphs are captured)",
    )
    parser.add_argument(
        "--pass-costs",
        choices=["cold", "carried"],
        default="cold",
        help="cold: the measured request is its process's first on a prompt of its length, so its cost "
        "model times plain steps first and warms up (a one-off run); carried: a warm-up request on the "
        "measured prompt comes first and the measured one starts from its pass costs, as a runtime's "
        "later requests (a job's, a server's) and a generate run after an earlier one on this machine do",
    )
    parser.add_argument(
        "--sampling",
        nargs="+",
        choices=sorted(SAMPLING),
        default=["greedy"],
        help="greedy and/or sample at temperature 0.7 / top-p 0.9 (seeded)",
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--document", choices=DOCUMENT_NAMES, default="plrabn12", help="prompt source")
    parser.add_argument(
        "--target", type=checkpoint_option, help="checkpoint directory (default: the provisioned SmolLM2)"
    )
    parser.add_argument(
        "--draft", type=checkpoint_option, help="draft checkpoint directory (default: the provisioned draft)"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for every cascade preset (repeatable)",
    )
    parser.add_argument(
        "--prompt-cache",
        type=prompt_cache_option,
        default=None,
        metavar="DIR",
        help="reuse prefilled prompts stored in DIR: cascade cases load the prompt's K/V "
        "instead of prefilling it, transformers' target continues from it (decode "
        "only; prefill is then not measured)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="report path (default: bench.json in a new run directory under "
        "$CASCADE_HOME/runs/bench/); a manifest is written beside it",
    )
    parser.add_argument(
        "--llama-flash-attn",
        choices=["both", *FLASH_ATTN],
        default="both",
        help="llama.cpp cases: flash attention off and on, the faster reported (both), or one setting "
        "(each setting prefills the context twice: at 32K most of a case's time)",
    )
    llama_tests = parser.add_mutually_exclusive_group()
    llama_tests.add_argument(
        "--llama-decode-only",
        action="store_true",
        help="llama.cpp cases: time decode at the context's depth only, without llama-bench's separate "
        "prefill test (which prefills the context once more; no llama.cpp prefill figure then)",
    )
    llama_tests.add_argument(
        "--llama-prefill-only",
        action="store_true",
        help="llama.cpp cases: time the context's prefill only, without the decode test at its depth "
        "(which prefills the context once more, untimed; no llama.cpp decode figure then)",
    )
    parser.add_argument(
        "--llama-repetitions",
        type=int,
        default=1,
        metavar="N",
        help="llama.cpp cases: repetitions within each round's run, their median reported; llama-bench "
        "prefills the context once for all of them (at 16K-32K a 1.5B model's prefill takes 15-40 min)",
    )
    parser.add_argument("--case", help=argparse.SUPPRESS)  # "impl:context": run one case, print JSON
    parser.add_argument("--store-only", action="store_true", help=argparse.SUPPRESS)  # 2 tokens: store the prompt
    parser.add_argument("--prompt-file", nargs="+", help=argparse.SUPPRESS)  # a transformers case continues from these
    args = parser.parse_args(argv)
    least_allowed = {
        "--new-tokens": (args.new_tokens, 2),
        "--repeats": (args.repeats, 1),
        "--warmups": (args.warmups, 0),
        "--contexts": (min(args.contexts), 1),
        "--llama-repetitions": (args.llama_repetitions, 1),
    }
    for flag, (value, least) in least_allowed.items():
        if value < least:
            parser.error(f"{flag} must be >= {least}; got {value}")
    return args


# ---- one case, in its own process -------------------------------------------------------------


def split_impl(impl: str) -> tuple[str, list[str]]:
    """``PRESET+KEY=VALUE+...`` -> (the implementation's name, its overrides)."""
    name, *overrides = impl.split("+")
    return name, overrides


def impl_option(value: str) -> str:
    """An implementation, or a preset followed by +KEY=VALUE overrides."""
    name, overrides = split_impl(value)
    malformed = ":" in value or any("=" not in item for item in overrides)
    if name not in IMPLS or malformed or (overrides and name not in PRESETS):
        raise argparse.ArgumentTypeError(f"{value!r}: expected one of {', '.join(IMPLS)}, or PRESET+KEY=VALUE...")
    return value


def needs_draft(name: str) -> bool:
    """Whether implementation ``name`` runs a draft model (a peer's, or a preset stage's)."""
    if name in PRESETS:
        return any(stage.get("model") == "draft" for stage in preset_data(name)["stages"])
    return name in PEERS_WITH_DRAFTS


def model_dirs(args: argparse.Namespace, impl: str) -> tuple[Path, Path | None]:
    from cascade.models import default_model

    target = args.target or default_model("target")
    if not needs_draft(split_impl(impl)[0]):
        return target, None
    return target, args.draft or default_model("draft", target=target)


def cascade_config(args, impl: str, target: Path, draft: Path | None, prompt: torch.Tensor, mode: str):
    """The validated config of ``impl`` (a preset and its +KEY=VALUE overrides) for this case."""
    from configs import load_config

    settings = {
        "dtype": args.dtype,
        "max_new_tokens": args.new_tokens,
        "target.path": str(target),
        "prompt_cache.dir": args.prompt_cache,
        **{f"sampling.{key}": value for key, value in SAMPLING[mode].items()},
    }
    preset, overrides = split_impl(impl)
    if draft is not None and not any(item.startswith("draft.path=") for item in overrides):
        settings["draft.path"] = str(draft)  # an impl naming its own draft keeps it (another family's, say)
    if scaling := yarn_scaling(target, prompt.numel() + args.new_tokens):
        settings["target.rope_scaling"] = scaling
    return load_config(preset, None, [*args.set, *overrides], settings)[1]


def run_cascade(
    args, impl: str, target: Path, draft: Path | None, prompt: torch.Tensor, mode: str
) -> tuple[dict, list[int]]:
    from cascade.huge_pages import huge_page_bytes
    from cascade.llm import LLM

    config = cascade_config(args, impl, target, draft, prompt, mode)
    llm = LLM.from_config(config, impl)
    runtime = llm.runtime
    if runtime.capture is None and args.pass_costs == "cold":
        # half the prompt: well short of what cascade.pass_costs.CARRY_WITHIN carries its costs to
        warmup = prompt[: min(WARMUP_TOKENS, prompt.numel() // 2)]
        warmup_tokens = min(args.new_tokens, WARMUP_NEW_TOKENS)
    else:  # graphs belong to the caches they were captured over: warm up those of the measured request
        warmup, warmup_tokens = prompt, args.new_tokens
    for _ in range(args.warmups):
        llm.run(llm.prepare(warmup.tolist(), max_new_tokens=warmup_tokens, ignore_eos=True))
    same_process = args.prompt_cache and split_impl(impl)[0] != "autoregressive" and not args.store_only
    twin = autoregressive_twin(llm, warmup, warmup_tokens, args) if same_process else None
    twin_rates = [twin_rate(twin, prompt, args)] if twin else []
    graphs_before = captured_graphs(runtime)
    # no EOS: exactly N tokens, like min_new_tokens; seeded from the config (seed 0)
    new_tokens = 2 if args.store_only else args.new_tokens
    result = llm.run(llm.prepare(prompt.tolist(), max_new_tokens=new_tokens, ignore_eos=True))
    graphs_captured = captured_graphs(runtime) - graphs_before
    twin_rates += [twin_rate(twin, prompt, args)] if twin else []
    stats = result.stats
    verifier = stats["stages"][-1]  # the full-cache target: its passes read its weights and the whole KV
    loaded = stats["prefill_loaded"] or verifier["prefill_reused"] > 0  # (some of) the prompt came from the store
    stored = runtime.prompt_caches["target"].passes(prompt, runtime.config.prefill_chunk) if args.prompt_cache else []
    return {
        "prefill_s": None if loaded else stats["prefill_s"],
        "decode_s": stats["decode_s"],
        "step_bytes": runtime.target.model.pass_weight_bytes()
        + verifier["kv_bytes_read"] / max(verifier["forward_calls"], 1),
        "prefill_tokens_per_s": None if loaded else prompt.numel() / stats["prefill_s"],
        "decode_tokens_per_s": stats["tokens_per_s"],
        "stats": stats,
        "graphs_captured_while_measured": graphs_captured,
        "same_process_autoregressive_runs_tokens_per_s": twin_rates or None,
        "same_process_autoregressive_tokens_per_s": statistics.harmonic_mean(twin_rates) if twin_rates else None,
        "huge_page_mb": None if (held := huge_page_bytes()) is None else held / 2**20,
        "prompt_files": [str(path) for path, _ in stored],
    }, result.token_ids


def autoregressive_twin(llm, warmup: torch.Tensor, warmup_tokens: int, args):
    """Autoregressive decoding on the target this case's process loaded (the same weights in the
    same memory), warmed up. This VM's speed differs by up to a third between processes, which a
    ratio to the autoregressive case (another process) carries and a ratio to this does not."""
    twin = llm.on_stages([llm.runtime.config.stages[-1]], "autoregressive")
    for _ in range(args.warmups):
        twin.run(twin.prepare(warmup.tolist(), max_new_tokens=warmup_tokens, ignore_eos=True))
    return twin


def twin_rate(twin, prompt: torch.Tensor, args) -> float:
    """Tokens/s of the twin's decode of the case's prompt (which comes from the prompt cache, so it
    costs a decode). It runs before and after the case, whose ratio is to the two runs' combined
    rate: the machine's speed drifts within a process too (a Qwen2.5 1.5B step at 8K took 109 ms in
    a process's first 14 s and 88-93 ms after), and a twin always run second rated the case low."""
    result = twin.run(twin.prepare(prompt.tolist(), max_new_tokens=args.new_tokens, ignore_eos=True))
    return result.stats["tokens_per_s"]


def captured_graphs(runtime) -> int:
    """How many pass shapes the runtime's stages hold as captured graphs."""
    return sum(stage.captured_passes for stage in runtime.stages)


class FirstTokenClock:
    """A generate() streamer that notes when the first new token arrives (after the prompt)."""

    def __init__(self) -> None:
        self.calls, self.first_token_at = 0, 0.0

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:
            value.cpu()  # on CUDA, wait until the token exists
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def continued_cache(paths: list[Path], config, length: int, device: torch.device):
    """A transformers cache holding the K/V [1, H_kv, T, D] of a stored prompt's first ``length``
    tokens (rotated keys, as transformers caches them), from the files of its passes in order."""
    from safetensors import safe_open
    from transformers import DynamicCache

    from cascade.prompt_cache import stored_layer

    cache = DynamicCache(config=config)
    with contextlib.ExitStack() as files:
        stored = [files.enter_context(safe_open(path, framework="pt", device=str(device))) for path in paths]
        for layer in range(config.num_hidden_layers):
            passes = [stored_layer(one, layer) for one in stored]
            keys, values = (torch.cat(parts, dim=2)[:, :, :length] for parts in zip(*passes))
            cache.update(keys, values, layer)
    return cache


def run_transformers(
    args, impl: str, target: Path, draft: Path | None, prompt: torch.Tensor, mode: str
) -> tuple[dict, list[int]]:
    """Prefill = time to the first new token; decode = the rest. With ``--prompt-cache`` the target
    continues from the prompt's K/V a cascade case stored (``prompt_files``; all but its last token, which
    generate() then feeds), so long prompts are not prefilled again; the assistant model (no stored
    cache) still prefills the whole prompt in its first call, within prefill time."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    from cascade.checkpoint import apply_rope_scaling
    from cascade.runtime import pick_device

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    dtype = getattr(torch, args.dtype)
    config = AutoConfig.from_pretrained(target)
    if scaling := yarn_scaling(target, prompt.numel() + args.new_tokens):
        apply_rope_scaling(config, scaling["kind"], scaling["factor"])  # the same stretch cascade applies
    device = pick_device()  # where cascade runs too
    model = AutoModelForCausalLM.from_pretrained(target, config=config, dtype=dtype).to(device).eval()
    prompt = prompt.to(device)
    extra = {}
    if impl == "transformers-assisted":
        extra["assistant_model"] = AutoModelForCausalLM.from_pretrained(draft, dtype=dtype).to(device).eval()
        tokenizers = AutoTokenizer.from_pretrained(target), AutoTokenizer.from_pretrained(draft)
        if tokenizers[0].get_vocab() != tokenizers[1].get_vocab():  # its universal assisted generation
            extra.update(tokenizer=tokenizers[0], assistant_tokenizer=tokenizers[1])
    sampling = SAMPLING[mode]
    if sampling["temperature"]:
        extra.update(do_sample=True, temperature=sampling["temperature"], top_p=sampling["top_p"], top_k=0)
    else:
        extra.update(do_sample=False)

    def timed(ids: torch.Tensor, new_tokens: int, **continued) -> tuple[float, float, list[int]]:
        clock = FirstTokenClock()
        torch.manual_seed(0)
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids[None, :],
                attention_mask=torch.ones_like(ids)[None, :],
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=model.config.eos_token_id,
                streamer=clock,
                **extra,
                **continued,
            )
        return (
            clock.first_token_at - started,
            time.perf_counter() - clock.first_token_at,
            out[0, ids.numel() :].tolist(),
        )

    for _ in range(args.warmups):
        timed(prompt[:WARMUP_TOKENS], min(args.new_tokens, WARMUP_NEW_TOKENS))
    continued = {}
    if args.prompt_file:
        stored = [Path(path) for path in args.prompt_file]
        continued["past_key_values"] = continued_cache(stored, model.config, prompt.numel() - 1, device)
    prefill_s, decode_s, tokens = timed(prompt, args.new_tokens, **continued)
    return {
        "prefill_s": None if continued else prefill_s,
        "decode_s": decode_s,
        "prefill_tokens_per_s": None if continued else prompt.numel() / prefill_s,
        "decode_tokens_per_s": (args.new_tokens - 1) / decode_s,
    }, tokens


def run_llamacpp(
    args, impl: str, target: Path, draft: Path | None, prompt: torch.Tensor, mode: str
) -> tuple[dict, list[int]]:
    """llama-bench (``llama.cpp-speculative``: llama-speculative with the draft's GGUF) on the
    target's GGUF of ``impl``'s type, YaRN-stretched as cascade stretches it, with as many threads as
    torch uses here (its own warm-up run stands for --warmups); its peak RSS is llama-bench's. No
    tokens: it samples none."""
    from cascade.peers.bench_case import context_case
    from cascade.peers.convert import peer_gguf
    from cascade.peers.llamacpp import ensure_built

    llama = ensure_built()
    tokens = prompt.numel() + args.new_tokens
    model = peer_gguf(llama, target, PEERS[impl], tokens)
    if impl == "llama.cpp-speculative":
        draft_model = peer_gguf(llama, draft, PEERS[impl], tokens)
        run = run_llamacpp_speculative(args, llama, model, draft_model, draft, prompt, SAMPLING[mode])
    else:
        flash_attn = FLASH_ATTN if args.llama_flash_attn == "both" else (args.llama_flash_attn,)
        tool, threads = llama.tool("llama-bench"), torch.get_num_threads()
        run = context_case(
            tool,
            model,
            prompt.numel(),
            args.new_tokens,
            threads,
            flash_attn,
            prefill=not args.llama_decode_only,
            repetitions=args.llama_repetitions,
            decode=not args.llama_prefill_only,
        )
    run["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return run, []


def run_llamacpp_speculative(
    args, llama, model: Path, draft_model: Path, draft: Path, prompt: torch.Tensor, sampling: dict
) -> dict:
    """llama-speculative at ``sampling``'s temperature and top-p (seed 0): ``draft_model``
    (the GGUF of checkpoint ``draft``) proposing to ``model`` on the prompt's text (which llama.cpp
    tokenizes again: the same tokenizer, so the same ids but for merges at the cut)."""
    import tempfile

    from transformers import AutoTokenizer

    from cascade.peers.speculative import SpeculativeSettings, run_speculative

    text = AutoTokenizer.from_pretrained(draft).decode(prompt.tolist())
    settings = SpeculativeSettings(
        new_tokens=args.new_tokens, threads=torch.get_num_threads(), batch=max(2048, prompt.numel()), **sampling
    )
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as prompt_file:
        prompt_file.write(text)
        prompt_file.flush()
        return run_speculative(llama.tool("llama-speculative"), model, draft_model, Path(prompt_file.name), settings)


def run_case(args: argparse.Namespace) -> dict:
    """One measurement of one case in this process: {"run": figures, "token_ids": generated}."""
    impl, context, mode = args.case.split(":")
    target, draft = model_dirs(args, impl)
    prompt = torch.tensor(document_ids(target, args.document, int(context)))
    runner = run_transformers if impl.startswith("transformers") else run_llamacpp if impl in PEERS else run_cascade
    run, tokens = runner(args, impl, target, draft, prompt, mode)
    run.setdefault("peak_rss_mb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if torch.cuda.is_available():
        run["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return {"run": run, "token_ids": tokens}


# ---- the driver: rounds of one subprocess per case, then the table and the JSON ---------------


RATES = ("decode_tokens_per_s", "prefill_tokens_per_s")


def spawn_case(args: argparse.Namespace, impl: str, context: int, mode: str) -> dict:
    command = [
        sys.executable,
        __file__,
        "--case",
        f"{impl}:{context}:{mode}",
        "--new-tokens",
        str(args.new_tokens),
        "--dtype",
        args.dtype,
        "--document",
        args.document,
        "--warmups",
        str(args.warmups),
        "--pass-costs",
        args.pass_costs,
        "--contexts",
        str(context),
        "--llama-flash-attn",
        args.llama_flash_attn,
        *(["--llama-decode-only"] if args.llama_decode_only else []),
        *(["--llama-prefill-only"] if args.llama_prefill_only else []),
        "--llama-repetitions",
        str(args.llama_repetitions),
        *(["--store-only"] if args.store_only else []),
        *(["--target", str(args.target)] if args.target else []),
        *(["--draft", str(args.draft)] if args.draft else []),
        *(["--prompt-cache", args.prompt_cache] if args.prompt_cache else []),
        *[arg for setting in args.set for arg in ("--set", setting)],
    ]
    if impl.startswith("transformers") and context in args.prompt_files:
        command += ["--prompt-file", *args.prompt_files[context]]
    result = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    if result.returncode != 0:
        raise CascadeError(f"the {impl} case at context {context} failed (exit {result.returncode})")
    return json.loads(result.stdout.strip().splitlines()[-1])


Case = tuple[str, int, str]
"""(implementation, context, sampling mode)."""


def run_round(
    args: argparse.Namespace, cases: list[Case], index: int, bar: tqdm, measured: dict, on_case: Callable[[], object]
) -> None:
    """Every case once, in order on even rounds and in reverse on odd ones, into ``measured`` ({case:
    measurement}); ``on_case`` is called after each case."""
    order = cases if index % 2 == 0 else cases[::-1]
    bandwidth = device_bandwidth()  # the machine drifts: each round is priced at its own bandwidth
    bar.write(f"[round {index + 1}/{args.repeats}] memory reads {bandwidth / 1e9:.1f} GB/s", file=sys.stderr)
    for slot, (impl, context, mode) in enumerate(order):
        same = next((case for key, case in measured.items() if key[:2] == (impl, context)), None)
        if impl in SAMPLING_FREE and same is not None:
            measured[(impl, context, mode)] = same
            bar.update(1)
            continue
        started = time.perf_counter()
        bar.set_postfix_str(f"round {index + 1}: {impl} @ {context} {mode}")
        case = spawn_case(args, impl, context, mode)
        run = case["run"]
        run.update(round=index, slot=slot, bandwidth_bytes_per_s=bandwidth)
        decode, prefill = (rate_text(run[key]) for key in RATES)
        bar.write(
            f"[round {index + 1}/{args.repeats} {impl:21} ctx {context:>6} {mode:6}] decode "
            f"{decode:>9} tok/s, prefill (tok/s) {prefill:>9}, "
            f"peak RSS {run['peak_rss_mb']:6.0f} MB{huge_page_text(run)} ({time.perf_counter() - started:.0f} s)",
            file=sys.stderr,
        )
        bar.update(1)
        measured[(impl, context, mode)] = case
        on_case()


def device_bandwidth() -> float:
    """Bytes per second of the memory cascade's passes read: the GPU's where there is one (the
    buffer then handed back to it, for the cases' processes), else the host's."""
    from cascade.runtime import pick_device

    device = pick_device()
    bandwidth = memory_bandwidth(device=device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return bandwidth


def huge_page_text(run: dict) -> str:
    """ ", in huge pages N MB" for a cascade case where Linux reports it, else nothing."""
    return "" if run.get("huge_page_mb") is None else f", in huge pages {run['huge_page_mb']:6.0f} MB"


def summarize(args: argparse.Namespace, case: Case, cases: list[dict], final: bool = True) -> dict:
    """One case over its rounds: median rates, maximum peak RSS, the per-round figures in ``runs``;
    the ``final`` summary also warns if greedy rounds generated different tokens."""
    impl, context, mode = case
    runs = [case["run"] for case in cases]
    if final and mode == "greedy" and any(case["token_ids"] != cases[0]["token_ids"] for case in cases):
        log(f"warning: {impl} at context {context} generated different tokens in different rounds")
    decode = median_of(run["decode_tokens_per_s"] for run in runs)  # None: a prefill-only llama.cpp case
    stages = runs[0].get("stats", {}).get("stages", [])[:-1]
    return {
        "preset": impl,
        "context": context,
        "temperature": SAMPLING[mode]["temperature"],
        "sampling": mode,
        "tokens_per_s": decode,
        "ms_per_token": None if decode is None else 1000 / decode,
        "speedup_vs_autoregressive": None,
        "acceptance": {stage["name"]: stage["acceptance_rate"] for stage in stages}
        or ({"draft": median_of(run["acceptance"] for run in runs)} if "acceptance" in runs[0] else {}),
        "new_tokens": args.new_tokens,
        "dtype": PEERS.get(impl, args.dtype),
        **{key: median_of(run[key] for run in runs) for key in RATES},
        **(flash_attn_summary(runs) if "flash_attn" in runs[0] else {}),
        "peak_rss_mb": max(run["peak_rss_mb"] for run in runs),
        "speedup_in_same_process": same_process_speedup(runs),
        "predicted_speedup": median_of(predictions) if (predictions := predicted_speedups(runs)) else None,
        "step_roofline_tokens_per_s": None,
        "decode_over_step_roofline": None,
        "runs": runs,
        "token_ids": cases[0]["token_ids"],
    }


def price_at_rooflines(runs: list[dict]) -> None:
    """Set each run's ``step_roofline_tokens_per_s``: the bandwidth of each round over the bytes one
    target step reads at its context (its weights once plus its whole KV, as a cascade case of that
    context measured them; the same checkpoint in the same precision for every implementation), the
    median over rounds; and ``decode_over_step_roofline``, its decode rate over that (at most 1 for
    autoregressive decoding; a speculating case can pass it)."""
    bf16_runs = [run for run in runs if run["dtype"] in ("bfloat16", "bf16") and run["tokens_per_s"] is not None]
    step_bytes = {}
    for run in bf16_runs:
        if measured := [case["step_bytes"] for case in run["runs"] if "step_bytes" in case]:
            step_bytes.setdefault(run["context"], statistics.median(measured))
    for run in bf16_runs:
        if (bytes_ := step_bytes.get(run["context"])) is None:
            continue
        rates = [case["bandwidth_bytes_per_s"] / bytes_ for case in run["runs"]]
        run["step_roofline_tokens_per_s"] = statistics.median(rates)
        run["decode_over_step_roofline"] = statistics.median(
            case["decode_tokens_per_s"] / rate for case, rate in zip(run["runs"], rates)
        )


def ratios(runs: list[dict], baseline: str) -> list[dict]:
    """Each implementation over the baseline per context and sampling: rates per round (side by side),
    then their median; peak RSS as the ratio of the cases' peaks. Greedy runs also count the tokens
    shared. Sets each run's ``speedup_vs_autoregressive`` when autoregressive is the baseline."""
    by_key = {(run["preset"], run["context"], run["sampling"]): run for run in runs}
    out = []
    for run in runs:
        base = by_key.get((baseline, run["context"], run["sampling"]))
        if run["preset"] == baseline or base is None:
            continue
        base_rounds = {case["round"]: case for case in base["runs"]}
        pairs = [(case, base_rounds[case["round"]]) for case in run["runs"] if case["round"] in base_rounds]
        if not pairs:  # a report written mid-round: the baseline not yet measured in this one
            continue
        per_round = {key: [None if None in (a[key], b[key]) else a[key] / b[key] for a, b in pairs] for key in RATES}
        row = {
            "preset": run["preset"],
            "baseline": baseline,
            "context": run["context"],
            "sampling": run["sampling"],
            **{key: median_of(per_round[key]) for key in RATES},
            "peak_rss_mb": run["peak_rss_mb"] / base["peak_rss_mb"],
            "per_round": per_round,
            "same_prefix_tokens": common_prefix(run["token_ids"], base["token_ids"])
            if run["token_ids"] and base["token_ids"]
            else None,
        }  # llama.cpp generates no text
        if baseline == "autoregressive":
            run["speedup_vs_autoregressive"] = row[RATES[0]]
            row["predicted_over_measured"] = prediction_error(pairs)
        out.append(row)
    return out


def predicted_speedups(runs: list[dict]) -> list[float]:
    """The cost model's predicted speed-up of each round of a speculating cascade case (empty for
    autoregressive decoding and the peers: nothing predicted)."""
    stages = [len(run.get("stats", {}).get("stages", [])) for run in runs]
    return [run["stats"]["predicted_speedup"] for run in runs] if min(stages) > 1 else []


def prediction_error(pairs: list[tuple[dict, dict]]) -> float | None:
    """The median over rounds of a speculating case's predicted speed-up over its measured one (its
    decode rate over autoregressive decoding's in the same round), or None: nothing predicted."""
    cases = [case for case, _ in pairs]
    if not (predicted := predicted_speedups(cases)):
        return None
    return statistics.median(p * base[RATES[0]] / case[RATES[0]] for p, (case, base) in zip(predicted, pairs))


def predictions_off(ratio_rows: list[dict]) -> list[dict]:
    """The cases whose predicted speed-up strays from the measured one by more than
    ``PREDICTION_TOLERANCE`` either way."""
    return [
        {key: row[key] for key in ("preset", "context", "sampling", "predicted_over_measured")}
        for row in ratio_rows
        if (error := row.get("predicted_over_measured")) is not None
        and not 1 / PREDICTION_TOLERANCE <= error <= PREDICTION_TOLERANCE
    ]


def median_of(values) -> float | None:
    """The median, or None if a value is missing (a prefill loaded from the prompt cache)."""
    values = list(values)
    return None if None in values else statistics.median(values)


def rate_text(rate: float | None) -> str:
    return "not timed" if rate is None else f"{rate:.1f}"


def ratio_text(row: dict | None) -> str:
    """A table's decode ratio: 1 for the baseline itself (no row), else the row's, if timed."""
    if row is None:
        return "1"
    return "not timed" if row[RATES[0]] is None else f"**{row[RATES[0]]:.2f}x**"


def roofline_text(run: dict) -> str:
    share = run["decode_over_step_roofline"]
    return "" if share is None else f"{share:.2f}"


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def table(runs: list[dict], ratio_rows: list[dict]) -> str:
    lines = [
        "| context | sampling | implementation | decode tok/s | prefill tok/s | peak RSS (MB) | decode vs "
        f"{ratio_rows[0]['baseline'] if ratio_rows else 'baseline'} | vs autoregressive, same process | "
        "predicted speed-up | decode / step roofline | acceptance per stage |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    ratio_of = {(row["preset"], row["context"], row["sampling"]): row for row in ratio_rows}
    for run in runs:
        ratio = ratio_of.get((run["preset"], run["context"], run["sampling"]))
        acceptance = " / ".join(f"{rate:.2f}" for rate in run["acceptance"].values())
        lines.append(
            f"| {run['context']} | {run['sampling']} | {run['preset']} | {rate_text(run['decode_tokens_per_s'])} | "
            f"{rate_text(run['prefill_tokens_per_s'])} | {run['peak_rss_mb']:.0f} | {ratio_text(ratio)} | "
            f"{same_process_text(run)} | {predicted_text(run)} | {roofline_text(run)} | {acceptance} |"
        )
    return "\n".join(lines)


def same_process_speedup(runs: list[dict]) -> float | None:
    """The median over rounds of a case's decode rate over its own process's autoregressive one
    (``same_process_autoregressive``), or None where it was not measured."""
    ratios = [
        run["decode_tokens_per_s"] / baseline
        for run in runs
        if (baseline := run.get("same_process_autoregressive_tokens_per_s"))
    ]
    return statistics.median(ratios) if ratios else None


def predicted_text(run: dict) -> str:
    predicted = run.get("predicted_speedup")
    return "" if predicted is None else f"{predicted:.2f}x"


def same_process_text(run: dict) -> str:
    speedup = run.get("speedup_in_same_process")
    return "" if speedup is None else f"{speedup:.2f}x"


def peer_table(peer: str, ratio_rows: list[dict]) -> str:
    """Every implementation's decode and prefill rates over the llama.cpp case ``peer``'s (medians of
    per-round ratios)."""
    lines = [
        f"| context | sampling | implementation | decode vs {peer} | prefill vs {peer} |",
        "|---:|---|---|---:|---:|",
    ]
    for row in ratio_rows:
        decode, prefill = ("not timed" if row[key] is None else f"**{row[key]:.2f}x**" for key in RATES)
        lines.append(f"| {row['context']} | {row['sampling']} | {row['preset']} | {decode} | {prefill} |")
    return "\n".join(lines)


def store_prompts(args: argparse.Namespace, cases: list[Case]) -> dict[int, list[str]]:
    """Run each cascade case once, unmeasured, so that every measured one loads its prompt (a first
    prefill and its write would otherwise set the peak RSS of one round) -> {context: the file
    holding its target prefill's passes}, which the transformers cases continue from."""
    files = {}
    for impl, context in dict.fromkeys((impl, context) for impl, context, _ in cases if split_impl(impl)[0] in PRESETS):
        started = time.perf_counter()
        storing = argparse.Namespace(**{**vars(args), "warmups": 0, "store_only": True})
        case = spawn_case(storing, impl, context, args.sampling[0])
        files[context] = case["run"]["prompt_files"]
        log(f"[prompt cache] {impl} at {context}: prompt stored or found ({time.perf_counter() - started:.0f} s)")
    if missing := sorted({context for impl, context, _ in cases if impl.startswith("transformers")} - set(files)):
        raise CascadeError(
            f"transformers cases continue from a cascade case's stored prompt, and contexts "
            f"{missing} have none: add a preset to --impls, or drop --prompt-cache"
        )
    return files


def prepare_peers(args: argparse.Namespace, cases: list[Case]) -> dict | None:
    """Build llama.cpp and write the GGUFs its cases run (once; minutes), so that no measured case
    includes them -> the build's description, or None without llama.cpp cases."""
    from cascade.peers.convert import peer_gguf
    from cascade.peers.llamacpp import ensure_built

    peers = dict.fromkeys((impl, context) for impl, context, _ in cases if impl in PEERS)
    if not peers:
        return None
    llama = ensure_built()
    for impl, context in peers:
        for checkpoint in filter(None, model_dirs(args, impl)):
            peer_gguf(llama, checkpoint, PEERS[impl], context + args.new_tokens)
    return llama.describe()


def drive(args: argparse.Namespace) -> None:
    cases = [(impl, context, mode) for mode in args.sampling for context in args.contexts for impl in args.impls]
    args.files = run_files("bench", args.out, "bench.json")
    args.llama_cpp = prepare_peers(args, cases)
    args.prompt_files = store_prompts(args, cases) if args.prompt_cache else {}
    rounds: list[dict] = []
    with tqdm(total=len(cases) * args.repeats, desc="bench", unit="case", file=sys.stderr) as bar:
        for index in range(args.repeats):  # the report is rewritten after each case: a cut-off run keeps them
            rounds.append({})
            run_round(args, cases, index, bar, rounds[-1], lambda: write_report(args, cases, rounds, final=False))
    runs, ratio_rows, peer_rows = write_report(args, cases, rounds)
    print(table(runs, ratio_rows))
    for peer, rows in peer_rows.items():
        print(f"\nllama.cpp {args.llama_cpp['llama_cpp_commit']}:\n{peer_table(peer, rows)}")
    for off in predictions_off(ratio_rows):
        log(
            f"warning: the cost model predicted {off['preset']} at {off['context']} ({off['sampling']}) "
            f"{off['predicted_over_measured']:.2f}x the speed-up measured (tolerance {PREDICTION_TOLERANCE}x)"
        )
    log(f"wrote {args.files.report} (manifest: {args.files.manifest})")


def write_report(
    args: argparse.Namespace, cases: list[Case], rounds: list[dict], final: bool = True
) -> tuple[list[dict], list[dict], dict[str, list[dict]]]:
    """The JSON report over the cases measured so far (``rounds``: {case: measurement} each, the
    last one possibly partial; ratios pair a case with its baseline of the same round) -> (its runs,
    its ratio rows, {llama.cpp case: every other implementation's ratio rows to it})."""
    measured = {case: [round_[case] for round_ in rounds if case in round_] for case in cases}
    runs = [summarize(args, case, done, final) for case, done in measured.items() if done]
    price_at_rooflines(runs)
    ratio_rows = ratios(runs, args.impls[0])
    peer_rows = {peer: ratios(runs, peer) for peer in args.impls if peer in PEERS and peer != args.impls[0]}
    settings = {
        key: getattr(args, key)
        for key in (
            "impls",
            "document",
            "contexts",
            "new_tokens",
            "repeats",
            "warmups",
            "pass_costs",
            "sampling",
            "dtype",
            "set",
            "prompt_cache",
            "llama_flash_attn",
            "llama_decode_only",
            "llama_prefill_only",
            "llama_repetitions",
        )
    }
    settings["order"] = "each round runs every case once, in its own process; odd rounds in reverse"
    report = {
        "machine": {**machine(), "llama_cpp": args.llama_cpp},
        "settings": settings,
        "rounds_done": sum(len(round_) == len(cases) for round_ in rounds),
        "cases_measured": sum(len(round_) for round_ in rounds),
        "runs": runs,
        "ratios": ratio_rows,
        "ratios_to_llama_cpp": peer_rows,
        "prediction_tolerance": PREDICTION_TOLERANCE,
        "predictions_off": predictions_off(ratio_rows),
    }
    args.files.write(report, settings)
    return runs, ratio_rows, peer_rows


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@entry_point
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args)))
    else:
        drive(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
