"""Images in the learner's forwards: a tiny Qwen2.5-VL (made from its transformers config, fp32),
its log-probs and every parameter's gradient (the vision tower's included) in padded, packed and
tree rows against each sequence alone under the model's own ``eager`` forward, which builds its
rotary positions itself; each distinct image through the vision tower once."""

from __future__ import annotations

import pytest
import torch
from families import build, laid_out

from rltrain.batch import TrainBatch
from rltrain.forward import attention, sequence_logprobs
from rltrain.forward.tree import build_tree, tree_logprobs
from rltrain.forward.vision import Images, rope_positions

START, END, IMAGE, VIDEO = 120, 121, 122, 123  # ids of the tiny vocabulary of 128 kept for them
IDS = dict(vision_start_token_id=START, vision_end_token_id=END, image_token_id=IMAGE, video_token_id=VIDEO)
PATCH = 3 * 2 * 14 * 14  # a patch row: channels x temporal patch x 14 x 14 pixels


def image(grid: tuple[int, int, int], seed: int) -> Images:
    g = torch.Generator().manual_seed(seed)
    t, h, w = grid
    return Images.of(torch.randn(t * h * w, PATCH, generator=g), torch.tensor([grid]))


def group_with_images():
    """Three completions (7, 12, 9 tokens) of one prompt holding an image of 4 x 4 patches (4
    placeholder tokens after 2 x 2 merging), a fourth sequence with another image (4 x 6 patches: 6
    placeholders) and two of them (the first image again and a third), a fifth without an image."""
    g = torch.Generator().manual_seed(0)

    def draw(n: int) -> list[int]:
        return torch.randint(3, START, (n,), generator=g).tolist()

    a, b, c = image((1, 4, 4), 1), image((1, 4, 6), 2), image((1, 6, 4), 3)
    shared = [*draw(3), START, *[IMAGE] * 4, END, *draw(5)]
    two = [*draw(2), START, *[IMAGE] * 4, END, *draw(1), START, *[IMAGE] * 6, END, *draw(2)]
    both = Images(
        torch.cat([a.pixel_values, c.pixel_values]), torch.cat([a.grid_thw, c.grid_thw]), a.keys + c.keys
    )
    prompts = [shared, shared, shared, [*draw(1), START, *[IMAGE] * 6, END, *draw(4)], two, draw(6)]
    completions = [draw(7), draw(12), draw(9), draw(10), draw(8), draw(6)]
    images = [a, a, a, b, both, None]
    return laid_out(prompts, completions), images


def alone(model, batch: TrainBatch, images, weights):
    """Each sequence alone through the model's own forward: pixels, grid and placeholder types in,
    the model's own rotary positions."""
    model.zero_grad()
    out = torch.zeros(batch.input_ids.shape)
    for b in range(len(batch)):
        keep = batch.attention_mask[b].bool()
        ids = batch.input_ids[b][keep][None]
        pixels = (
            {}
            if images[b] is None
            else {"pixel_values": images[b].pixel_values, "image_grid_thw": images[b].grid_thw}
        )
        logits = model(
            input_ids=ids, mm_token_type_ids=(ids == IMAGE).int(), use_cache=False, **pixels
        ).logits
        lp = torch.cat([torch.zeros(1), logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]])
        (lp * weights[b][keep]).sum().backward()
        out[b, keep] = lp.detach()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_images_are_exact_in_padded_packed_and_tree_rows_and_each_distinct_image_is_encoded_once():
    batch, images = group_with_images()
    weights = (
        torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(1)) * batch.response_mask
    )
    reference, reference_grads = alone(build("qwen2.5-vl", **IDS), batch, images, weights)
    assert any("visual" in n for n in reference_grads)  # the tower trains here: its gradients compared too
    keep = batch.response_mask.bool()
    for layout in ("padded", "packed", "tree"):
        model = build("qwen2.5-vl", attention.register(), **IDS)
        encoded: list[int] = []
        model.model.visual.register_forward_pre_hook(
            lambda _m, args, seen=encoded: seen.append(args[0].shape[0])
        )
        if layout == "tree":
            tree = build_tree(batch.input_ids, batch.attention_mask, ~batch.response_mask.bool())
            assert tree.shared_fraction > 0.2  # the group's prompt, its image's placeholders included, once
            lp, _ = tree_logprobs(model, tree, batch.input_ids, images=images)
        else:
            lp, _ = sequence_logprobs(
                model, batch.input_ids, batch.attention_mask, packed=layout == "packed", images=images
            )
        (lp * weights).sum().backward()
        # three distinct images of 16, 24 and 24 patches, each once (the sequences hold 7 images)
        assert encoded == [16 + 24 + 24], (layout, encoded)
        worst = (lp.detach() - reference)[keep].abs().max().item()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        grad_gap = max(
            ((grads[n] - g).norm() / g.norm().clamp(min=1e-12)).item() for n, g in reference_grads.items()
        )
        assert worst < 1e-5 and grad_gap < 1e-5, (layout, worst, grad_gap)


def test_rotary_positions_are_the_models_own_and_text_positions_would_be_wrong():
    model = build("qwen2.5-vl", **IDS)
    batch, images = group_with_images()
    keep = batch.attention_mask[4].bool()
    ids = batch.input_ids[4][keep]
    positions = rope_positions(model, ids, images[4])
    # 2 text tokens, vision start (position 2), an image of 2 x 2 merged placeholders on its grid at
    # t=3: heights 3,3,4,4 and widths 3,4,3,4, then the text resumes at 3 + 2 = 5
    assert positions[:, 3:7].tolist() == [[3, 3, 3, 3], [3, 3, 4, 4], [3, 4, 3, 4]]
    assert positions[:, 7].tolist() == [5, 5, 5]  # the vision end token
    # the positions a text row would get differ from the image's from its first placeholder on
    assert not torch.equal(positions[0], torch.arange(len(ids)))
    # a sequence whose images do not fill its placeholders; a text model given images
    with pytest.raises(ValueError, match="placeholder"):
        sequence_logprobs(model, batch.input_ids[3:4], batch.attention_mask[3:4], images=[images[0]])
    with pytest.raises(ValueError, match="Qwen2ForCausalLM has none"):
        sequence_logprobs(build("qwen2"), batch.input_ids[5:], batch.attention_mask[5:], images=[None])
