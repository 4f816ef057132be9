"""The end-of-run report recipes print (offbeat.core.trainer.report)."""

from offbeat.core.trainer.report import print_report


def test_the_report_names_the_recipe_the_validation_and_the_prompts(capsys):
    summary = {
        "steps": 3, "version": 3, "total_wall_s": 61.2, "startup_s": 20.4,
        "val_history": [(0, 0.25), (2, 0.75), (3, 0.5)],
        "counts": {"submitted": 40, "trained": 24, "evicted": 1, "failed": 2,
                   "pending": 3, "running": 4, "finished": 6},
        "metrics": "m.jsonl", "plot": "p.png", "trace": None, "logs": "logs",
    }  # fmt: skip
    print_report(summary, "my_recipe")
    out = capsys.readouterr().out
    assert "=== my_recipe finished ===" in out
    assert (
        "validation reward: 0.250 (version 0) -> 0.500 (version 3), best 0.750 (version 2)" in out
    )
    assert "trained 24, evicted 1, failed 2, still in flight 13" in out
    assert "engine and Ray logs: logs/" in out and "step timeline" not in out
