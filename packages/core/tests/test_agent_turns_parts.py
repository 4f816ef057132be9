"""The multi-turn tool loop with list-style chat content (a VLM processor's chat template,
the tiny Qwen2-VL's): a prompt given as text parts, turns of sampled tokens, tool results
in between. The trajectory is the template's rendering of the whole conversation token
for token, whether the messages are written as strings or as lists of text parts; a row
with images goes through the processor (placeholders widened) and sends its images with
every turn, and without a processor it is refused rather than sampled without them."""

from __future__ import annotations

import asyncio

import pytest
from agent_fakes import ScriptedClient, call_text, expected_conversation

from offbeat.core.agent import ToolAgentLoop, ToolLoopConfig, TurnTemplate, load_tool
from offbeat.core.rewards import RewardRegistry
from offbeat.core.tasks.images import content_parts
from offbeat.core.trainer import GroupFailed

PARTS_ROW = {
    "prompt": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is 12*34? "},
                {"type": "text", "text": "Use the calculator."},
            ],
        },
    ],
    "data_source": "math",
    "ground_truth": "408",
}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoProcessor

    from offbeat.core.models import build_tiny_vlm

    return AutoProcessor.from_pretrained(
        build_tiny_vlm(tmp_path_factory.mktemp("vl") / "m")
    ).tokenizer


def _loop(tok, client, processor=None):
    return ToolAgentLoop(
        client, tok, RewardRegistry({}), {"temperature": 1.0, "max_tokens": 512},
        tools=[load_tool("calculator")], config=ToolLoopConfig(max_turns=4),
        max_prompt_length=4096, **({"processor": processor} if processor else {}),
    )  # fmt: skip


@pytest.mark.parametrize("turns", [1, 3])
def test_list_style_content_keeps_token_exact_turn_boundaries(tok, turns):
    layout = TurnTemplate(tok)
    script = [call_text(f"{k + 2}*{k + 3}") for k in range(turns - 1)] + ["It is 408."]
    client = ScriptedClient(tok, layout.end_of_turn_id, script)
    (traj,) = asyncio.run(_loop(tok, client).sample("g", PARTS_ROW, 1))
    calls = client.session_calls("g-0")
    assert len(calls) == turns and traj.reward == 1.0
    conv = expected_conversation(tok, calls, layout.eos_ids)
    whole = [*PARTS_ROW["prompt"], *conv]
    expected = layout.render(whole)
    # Strings or text parts: the template renders the same tokens.
    assert layout.render(content_parts(whole)) == expected
    assert "What is 12*34? Use the calculator." in tok.decode(traj.prompt_ids)
    ids = traj.prompt_ids + traj.response_ids
    assert ids + layout.closing_ids(calls[-1]["ids"]) == expected
    sampled = [t for c in calls for t in c["ids"]]
    assert [t for t, m in zip(traj.response_ids, traj.response_mask or [1] * len(ids),
                              strict=False) if m] == sampled  # fmt: skip
    for c in calls:  # each turn's prompt is the trajectory so far
        assert ids[: len(c["prompt"])] == c["prompt"]


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    from transformers import AutoProcessor

    from offbeat.core.models import build_tiny_vlm

    return AutoProcessor.from_pretrained(build_tiny_vlm(tmp_path_factory.mktemp("vlp") / "m"))


def _image_row():
    from offbeat.core.tasks.visual import visual_image

    parts = [{"type": "image"}, *PARTS_ROW["prompt"][0]["content"]]
    return {**PARTS_ROW, "prompt": [{"role": "user", "content": parts}],
            "images": [visual_image([0], "red")]}  # fmt: skip


def test_a_row_with_images_sends_them_on_every_turn(processor):
    from offbeat.core.data.vision import MULTI_MODAL_DATA, png_bytes
    from offbeat.core.tasks.images import decode_image

    tok = processor.tokenizer
    layout = TurnTemplate(tok)
    row = _image_row()
    client = ScriptedClient(tok, layout.end_of_turn_id, [call_text("2*3"), "It is 408."])
    (traj,) = asyncio.run(_loop(tok, client, processor).sample("g", row, 1))
    calls = client.session_calls("g-0")
    assert len(calls) == 2 and traj.reward == 1.0
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    assert traj.prompt_ids.count(image_id) == 16  # the placeholder widened to its tokens
    assert traj.multi_modal is not None and traj.multi_modal["image_grid_thw"].tolist() == [
        [1, 8, 8]
    ]
    want = {"image": [png_bytes(decode_image(row["images"][0]))]}
    assert [c["params"][MULTI_MODAL_DATA] for c in calls] == [want, want]
    ids = traj.prompt_ids + traj.response_ids
    for c in calls:  # still token-exact: each turn's prompt is the trajectory so far
        assert ids[: len(c["prompt"])] == c["prompt"]


def test_the_tool_loop_refuses_a_row_with_images_without_a_processor(tok):
    row = _image_row()
    client = ScriptedClient(tok, tok.convert_tokens_to_ids("<|im_end|>"), ["x"])
    with pytest.raises(GroupFailed, match="images") as e:
        asyncio.run(_loop(tok, client).sample("g", row, 1))
    assert e.value.reason == "prompt_error" and not client.calls
