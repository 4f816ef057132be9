"""Write `verl_example.parquet`: a few GSM8K-style and MATH-style rows in verl's dataset
format, exactly as verl's preprocessing scripts (`gsm8k.py`, `math_dataset.py`) lay them
out, so that a verl user's files and this one read the same way.

    python recipes/separate_async/data/make_verl_example.py [OUT.parquet]

The questions are short originals in the style of each dataset (not copied from them):
prompts stay under ~220 tokens with the tiny model's one-token-per-byte tokenizer.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

# verl's instruction suffixes (examples/data_preprocess/gsm8k.py, math_dataset.py)
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."

# (question, worked solution ending in "#### <answer>")
GSM8K = [
    (
        "Mia has 12 marbles. She gives 5 to her brother and buys 8 more. "
        "How many marbles does she have now?",
        "She has 12 - 5 = <<12-5=7>>7 left, then 7 + 8 = <<7+8=15>>15.\n#### 15",
    ),
    (
        "A baker makes 4 trays of 9 muffins and sells 30 of them. How many muffins are left?",
        "He makes 4 * 9 = <<4*9=36>>36 muffins, so 36 - 30 = <<36-30=6>>6 are left.\n#### 6",
    ),
    (
        "Tom reads 15 pages a day. How many pages does he read in 2 weeks?",
        "2 weeks are 2 * 7 = <<2*7=14>>14 days, so 15 * 14 = <<15*14=210>>210 pages.\n#### 210",
    ),
    (
        "A shirt costs $25 and is on sale for 20% off. What is the sale price in dollars?",
        "The discount is 25 * 0.2 = <<25*0.2=5>>5, so the price is 25 - 5 = <<25-5=20>>20.\n#### 20",
    ),
    (
        "Sara walks 3 miles each morning and 2 miles each evening. How far does she walk in 5 days?",
        "Each day she walks 3 + 2 = <<3+2=5>>5 miles, so 5 * 5 = <<5*5=25>>25 miles.\n#### 25",
    ),
    (
        "A school has 1,200 students and 3/4 of them take the bus. How many take the bus?",
        "3/4 of 1200 is 1200 * 3 / 4 = <<1200*3/4=900>>900 students.\n#### 900",
    ),
]

# (data_source, question, answer: the content of the solution's last \boxed{})
MATH = [
    (
        "DigitalLearningGmbH/MATH-lighteval",
        "What is $\\frac{1}{2} + \\frac{1}{3}$?",
        "\\frac{5}{6}",
    ),
    ("DigitalLearningGmbH/MATH-lighteval", "Solve for $x$: $3x - 7 = 11$.", "6"),
    ("lighteval/MATH", "What is $\\sqrt{144} + \\sqrt{25}$?", "17"),
    ("lighteval/MATH", "Find the slope of the line through $(1, 2)$ and $(3, 8)$.", "3"),
    ("HuggingFaceH4/MATH-500", "Simplify $\\frac{6}{8}$.", "\\frac{3}{4}"),
    (
        "HuggingFaceH4/MATH-500",
        "In degrees, what is each interior angle of a regular hexagon?",
        "120^\\circ",
    ),
]


def make_rows() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for i, (question, solution) in enumerate(GSM8K):
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {
                    "style": "rule",
                    "ground_truth": solution.split("#### ")[-1].replace(",", ""),
                },
                "extra_info": {
                    "split": "train",
                    "index": i,
                    "answer": solution,
                    "question": question,
                },
            }
        )
    for i, (source, question, answer) in enumerate(MATH):
        rows.append(
            {
                "data_source": source,
                "prompt": [{"role": "user", "content": f"{question} {MATH_INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"split": "train", "index": i},
            }
        )
    return rows


def write(path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(make_rows()), path)
    return path


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else Path(__file__).with_name("verl_example.parquet")
    print(write(out))
