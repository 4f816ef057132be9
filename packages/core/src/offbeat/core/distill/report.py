"""The OPD run's picture and table: reverse KL per teacher over steps, and validation
reward per task for the student over weight versions beside each task's teacher.

Knows only metric rows (dicts with `step` and `distill/...`, `val/...` keys) and the
teachers' final per-task validation; draws with matplotlib (Agg), writes a PNG.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["plot_opd", "task_table"]


def task_table(
    student: Mapping[str, float],
    teachers: Mapping[str, Mapping[str, float]],
    routes: Mapping[str, str],
) -> list[tuple[str, float, str, float]]:
    """(task, student reward, its teacher, teacher reward) per task; `routes`: task ->
    teacher name."""
    rows = []
    for key, value in sorted(student.items()):
        if not (key.startswith("val/") and key.endswith("/reward")) or key == "val/reward":
            continue
        task = key[len("val/") : -len("/reward")]
        teacher = routes.get(task, "")
        rows.append((task, value, teacher, teachers.get(teacher, {}).get(key, float("nan"))))
    return rows


def plot_opd(
    history: Sequence[Mapping[str, float]],
    teacher_val: Mapping[str, Mapping[str, float]],
    routes: Mapping[str, str],
    path: str | Path,
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_kl, ax_val) = plt.subplots(2, 1, figsize=(7, 8))
    kl_keys = sorted({k for r in history for k in r if k.endswith("/reverse_kl")})
    for key in kl_keys:
        pts = [(r["step"], r[key]) for r in history if key in r]
        ax_kl.plot(*zip(*pts, strict=True), marker="o", label=key.split("/")[1])
    ax_kl.set_ylabel("reverse KL (student || teacher), token mean")
    ax_kl.set_xlabel("global step")
    ax_kl.legend()
    val_keys = sorted(
        {k for r in history for k in r if k.startswith("val/") and k.endswith("/reward")}
        - {"val/reward"}
    )
    for key in val_keys:
        task = key[len("val/") : -len("/reward")]
        pts = [(r["step"], r[key]) for r in history if key in r]
        (line,) = ax_val.plot(*zip(*pts, strict=True), marker="o", label=f"student: {task}")
        teacher = routes.get(task)
        if teacher and key in teacher_val.get(teacher, {}):
            ax_val.axhline(
                teacher_val[teacher][key], ls="--", color=line.get_color(),
                label=f"teacher {teacher}: {task}",
            )  # fmt: skip
    ax_val.set_ylabel("validation reward")
    ax_val.set_xlabel("weight version")
    ax_val.set_ylim(-0.05, 1.05)
    ax_val.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
