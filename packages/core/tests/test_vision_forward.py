"""The trainer's side of vision-language prompts, on the tiny Qwen2-VL: the processor's
prompt ids and vision inputs ride on each trajectory, and the train engine's log-probs of
a padded batch of image prompts are those of each trajectory's own forward."""

from __future__ import annotations

import pytest
import torch
from PIL import Image, ImageDraw

from offbeat.core.data import Trajectory, TrajectoryBatch
from offbeat.core.data.vision import encode_vision_prompt
from offbeat.core.models import build_tiny_vlm
from offbeat.core.train import FSDP2Config, FSDP2TrainEngine, OptimConfig, PPOLoss, PPOLossConfig


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from transformers import AutoProcessor

    path = build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "m", seed=0)
    return path, AutoProcessor.from_pretrained(path)


def _image(colour: str, boxes: int) -> Image.Image:
    im = Image.new("RGB", (112, 112), "white")
    d = ImageDraw.Draw(im)
    for k in range(boxes):
        d.rectangle([8 + 34 * k, 40, 30 + 34 * k, 62], fill=colour)
    return im


def _trajectories(processor) -> list[Trajectory]:
    """Two prompts of different lengths (one image, two images) with responses of
    different lengths: the batch pads on both sides."""
    g = torch.Generator().manual_seed(0)
    specs = [([_image("red", 1)], "how many?"), ([_image("blue", 2), _image("red", 3)], "more?")]
    out = []
    for k, (images, text) in enumerate(specs):
        parts = [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]
        p = encode_vision_prompt(processor, [{"role": "user", "content": parts}], images)
        response = torch.randint(32, 127, (3 + 4 * k,), generator=g).tolist()
        out.append(Trajectory(p.prompt_ids, response, [0.0] * len(response),
                              group_uid=f"g{k}", multi_modal=p.model_inputs))  # fmt: skip
    return out


def test_the_processor_widens_each_image_and_gives_its_grid(vlm):
    _, processor = vlm
    t1, t2 = _trajectories(processor)
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert t1.prompt_ids.count(image_id) == 16 and t2.prompt_ids.count(image_id) == 32
    assert t2.multi_modal["image_grid_thw"].tolist() == [[1, 8, 8], [1, 8, 8]]
    assert tuple(t2.multi_modal["pixel_values"].shape) == (128, 3 * 2 * 14 * 14)


def test_engine_log_probs_of_padded_image_prompts_are_each_rows_own(vlm):
    from transformers import Qwen2VLForConditionalGeneration

    path, processor = vlm
    trajectories = _trajectories(processor)
    batch = TrajectoryBatch.pad(trajectories, pad_token_id=processor.tokenizer.pad_token_id)
    engine = FSDP2TrainEngine(
        FSDP2Config(model_path=str(path), device="cpu", micro_batch_size=1,
                    optim=OptimConfig(lr=1e-3)),
        loss_fn=PPOLoss(PPOLossConfig()),
    )  # fmt: skip
    got = engine.compute_log_probs(batch)
    model = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    image_id = model.config.image_token_id
    for i, t in enumerate(trajectories):
        ids = torch.tensor([t.prompt_ids + t.response_ids])
        with torch.no_grad():
            logits = model(input_ids=ids, mm_token_type_ids=(ids == image_id).long(),
                           **t.multi_modal).logits[0]  # fmt: skip
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        want = lp[len(t.prompt_ids) - 1 :]
        m = len(t.response_ids)
        torch.testing.assert_close(got[i, :m], want, atol=1e-4, rtol=0)
        assert (got[i, m:] == 0).all()
    # The images matter: row 0's tokens with another image score otherwise.
    other = encode_vision_prompt(
        processor, [{"role": "user", "content": [{"type": "image"}]}], [_image("green", 3)]
    ).model_inputs
    swapped = batch.select([0])
    swapped.multi_modal = [other]
    m = len(trajectories[0].response_ids)
    assert (engine.compute_log_probs(swapped)[0, :m] - got[0, :m]).abs().max() > 1e-2
    # A row whose image tokens have no image is refused, not scored as text.
    swapped.multi_modal = [None]
    with pytest.raises(ValueError):
        engine.compute_log_probs(swapped)


def test_a_batch_keeps_each_rows_vision_inputs_through_select_split_and_concat(vlm):
    _, processor = vlm
    t1, t2 = _trajectories(processor)
    text = Trajectory([1, 2], [3], [0.0])
    batch = TrajectoryBatch.concat([TrajectoryBatch.pad([t1, text]), TrajectoryBatch.pad([t2])])
    assert [m is None for m in batch.multi_modal] == [False, True, False]
    assert batch.select([2]).multi_modal[0] is t2.multi_modal
    assert [b.multi_modal for b in batch.split(2)][1] == [t2.multi_modal]
    assert batch.unpad()[0].multi_modal is t1.multi_modal
    assert TrajectoryBatch.pad([text]).multi_modal is None
