"""ZipRerank: one forward per window, QI-EI pruning, soft-ranking and RankNet losses, recall/nDCG.

The listwise scorer is tested with the tiny text LM (closedloop/models/tiny.py); no tiny VLM is
built here, so page images are not exercised.
"""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from closedloop.tool import ToolRegistry
from closedloop.tools.ziprerank import (
    TOOLS,
    ListwiseReranker,
    RankingExample,
    evaluate_ranking_set,
    n_windows,
    ndcg_at_k,
    qi_ei_prune,
    qi_ei_scores,
    ranknet_loss,
    recall_at_k,
    soft_ranking_loss,
    soft_targets,
)

REG = ToolRegistry().extend(TOOLS)


def call(name, args):
    return asyncio.run(REG.get(name).run(args))


@pytest.fixture(scope="module")
def reranker(tiny_model_path):
    torch.set_num_threads(1)
    return ListwiseReranker.from_spec(f"hf:{tiny_model_path}", window=6, stride=3)


class CountForwards:
    def __init__(self, model):
        self.n = 0
        self.handle = model.register_forward_hook(self)

    def __call__(self, *_):
        self.n += 1


DOCS = [f"passage {i} about topic {i % 4}" for i in range(14)]


@pytest.mark.parametrize("n", [1, 4, 6, 7, 14])
def test_one_forward_per_window_and_output_is_a_permutation(reranker, n):
    counter = CountForwards(reranker.model)
    try:
        perm, scores = reranker.rerank("topic 2", DOCS[:n])
    finally:
        counter.handle.remove()
    assert sorted(perm) == list(range(n))
    assert counter.n == n_windows(n, 6, 3) == (1 if n <= 6 else 1 + math.ceil((n - 6) / 3))
    if n <= 6:
        assert len(scores) == n and perm == sorted(range(n), key=lambda i: -scores[i])


def test_scores_are_first_token_logits_of_the_labels(reranker):
    tok, model = reranker.tokenizer, reranker.model
    docs = DOCS[:5]
    scores = reranker.score_window("topic 1", docs)
    # Independently: the chat prompt ends with the generation prompt and '['; logits of 'A'..'E'.
    inputs = reranker.text_inputs("topic 1", docs)
    assert tok.decode(inputs["input_ids"][0, -1:]) == "["
    assert "[C] passage 2 about topic 2" in tok.decode(inputs["input_ids"][0])
    with torch.no_grad():
        logits = model(input_ids=inputs["input_ids"]).logits[0, -1]
    ids = [tok.encode(c, add_special_tokens=False)[0] for c in "ABCDE"]
    torch.testing.assert_close(scores, logits[ids])
    # Permuting the candidates changes the prompt: scores follow the content, not only the label.
    assert not torch.equal(scores, reranker.score_window("topic 1", docs[::-1]))


def test_reranker_rejects_bad_windows(reranker):
    with pytest.raises(ValueError, match="window"):
        ListwiseReranker(reranker.model, reranker.tokenizer, window=27)
    with pytest.raises(ValueError, match="stride"):
        ListwiseReranker(reranker.model, reranker.tokenizer, window=5, stride=6)
    with pytest.raises(ValueError, match="no candidates"):
        reranker.rerank("q", [])


def test_pruner_keeps_round_rho_n_best_patches_in_spatial_order():
    g = torch.Generator().manual_seed(0)
    text, patches = torch.randn(4, 16, generator=g), torch.randn(37, 16, generator=g)
    s = qi_ei_scores(text, patches)
    manual = torch.stack([max(F.cosine_similarity(t, p, dim=0) for t in text) for p in patches])
    torch.testing.assert_close(s, manual)
    for rho in (0.01, 0.25, 0.5, 0.9):
        kept, idx = qi_ei_prune(text, patches, rho)
        k = max(1, round(rho * 37))
        assert len(idx) == k and torch.all(idx[1:] > idx[:-1])
        assert set(idx.tolist()) == set(torch.topk(s, k).indices.tolist())
        torch.testing.assert_close(kept, patches[idx])
    assert len(qi_ei_prune(text, patches, 0.5, "ceil")[1]) == 19  # ⌈18.5⌉
    assert len(qi_ei_prune(text, patches[:5], 0.5)[1]) == 2  # round(2.5) = 2, as Python rounds
    with pytest.raises(ValueError, match="rho"):
        qi_ei_prune(text, patches, 0.0)
    with pytest.raises(ValueError, match="same D"):
        qi_ei_scores(text, patches[:, :8])


def test_rho_one_is_a_no_op():
    g = torch.Generator().manual_seed(1)
    text, patches = torch.randn(3, 8, generator=g), torch.randn(20, 8, generator=g)
    kept, idx = qi_ei_prune(text, patches, 1.0)
    assert torch.equal(kept, patches) and idx.tolist() == list(range(20))


def test_soft_targets_sum_to_one_with_maximum_on_ground_truth():
    t = soft_targets(6, teacher_order=[3, 0, 5, 1, 2, 4], relevant=[2], decay=0.5)
    assert float(t.sum()) == pytest.approx(1.0)
    assert int(t.argmax()) == 2
    # GT at position 0, then the teacher order without the GT: 3, 0, 5, 1, 4.
    w = {2: 1, 3: 0.5, 0: 0.25, 5: 0.125, 1: 0.0625, 4: 0.03125}
    expect = torch.tensor([w[i] for i in range(6)], dtype=torch.float64)
    torch.testing.assert_close(t, expect / expect.sum())
    two = soft_targets(4, [0, 1, 2, 3], relevant=[3, 1])
    assert two[3] > two[1] > two[0] > two[2]
    with pytest.raises(ValueError, match="outside"):
        soft_targets(3, [0, 1, 7], [0])


def test_soft_ranking_loss_is_cross_entropy_and_minimised_by_the_targets():
    scores = torch.tensor([0.3, -1.0, 2.0, 0.5], dtype=torch.float64, requires_grad=True)
    loss = soft_ranking_loss(scores, [1, 0, 3, 2], [2])
    t = soft_targets(4, [1, 0, 3, 2], [2])
    assert loss.item() == pytest.approx(float(-(t * torch.log_softmax(scores.detach(), 0)).sum()))
    loss.backward()
    torch.testing.assert_close(scores.grad, torch.softmax(scores.detach(), 0) - t)  # CE gradient
    best = soft_ranking_loss(torch.log(t), [1, 0, 3, 2], [2])
    assert float(best) == pytest.approx(float(-(t * torch.log(t)).sum()))  # = entropy, the minimum
    assert float(best) < loss.item()


def test_ranknet_is_pairwise_bce_on_score_differences():
    s = torch.tensor([1.0, 0.2, -0.5, 0.7], dtype=torch.float64)
    rel = torch.tensor([2.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    pairs = [(i, j) for i in range(4) for j in range(4) if rel[i] > rel[j]]
    manual = np.mean([math.log1p(math.exp(-(s[i] - s[j]).item())) for i, j in pairs])
    assert float(ranknet_loss(s, rel)) == pytest.approx(manual)
    assert float(ranknet_loss(torch.tensor([3.0, 0.0, 1.0, 0.0]) * 10, rel.float())) < 1e-4  # separated by ≥ 10: softplus(−10)
    with pytest.raises(ValueError, match="no pair"):
        ranknet_loss(s, torch.ones(4, dtype=torch.float64))


def test_recall_and_ndcg_on_known_rankings():
    assert recall_at_k([3, 1, 0, 2], [1, 2], 1) == 0 and recall_at_k([3, 1, 0, 2], [1, 2], 2) == 0.5
    assert recall_at_k([3, 1, 0, 2], [1, 2], 4) == 1
    assert ndcg_at_k([1, 0], [1], 2) == 1
    assert ndcg_at_k([0, 1], [1], 2) == pytest.approx(1 / math.log2(3))
    assert ndcg_at_k([2, 0, 1], [1, 2], 3) == pytest.approx((1 + 1 / math.log2(4)) / (1 + 1 / math.log2(3)))


def test_evaluate_reports_first_stage_and_reranked_metrics(reranker, tmp_path):
    examples = [RankingExample(query="topic 1", candidates=DOCS[:5], relevant=[1]),
                RankingExample(query="topic 3", candidates=DOCS[:8], relevant=[3, 7])]
    out = evaluate_ranking_set(reranker, examples, ks=(1, 3))
    assert out["first_stage"]["recall@1"] == pytest.approx(0.0)
    assert out["first_stage"]["recall@3"] == pytest.approx(0.5)  # 1 ∈ top-3 of the first, nothing of the second
    assert out["n_forwards"] == 1 + n_windows(8, 6, 3)
    for v in out["reranked"].values():
        assert 0 <= v <= 1
    path = tmp_path / "set.jsonl"
    path.write_text("\n".join(e.model_dump_json() for e in examples))
    res = call("ziprerank_evaluate", {"model": f"hf:{reranker.model.name_or_path}", "ranking_set": str(path),
                                      "ks": [1, 3], "window": 6, "stride": 3})
    assert res.ok, res.error
    assert json.loads(res.content)["reranked"] == out["reranked"]


def test_tools_and_clear_errors(tiny_model_path, tmp_path):
    res = call("ziprerank_rerank", {"model": f"hf:{tiny_model_path}", "query": "q", "candidates": DOCS[:3]})
    assert res.ok and sorted(json.loads(res.content)["permutation"]) == [0, 1, 2]
    missing = call("ziprerank_rerank", {"model": f"hf:{tmp_path}/nope", "query": "q", "candidates": ["a"]})
    assert missing.error_kind == "invalid_arguments" and "no checkpoint directory there" in missing.error
    assert "not found" in call("ziprerank_evaluate", {"model": f"hf:{tiny_model_path}",
                                                      "ranking_set": str(tmp_path / "none.jsonl")}).error
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"query": "q", "candidates": ["a"], "relevant": [3]}))
    assert "outside" in call("ziprerank_evaluate", {"model": f"hf:{tiny_model_path}", "ranking_set": str(bad)}).error
    out = json.loads(call("ziprerank_prune_patches", {"text_embeddings": [[1.0, 0.0]],
                                                      "patch_embeddings": [[0, 1], [1, 0.1], [-1, 0], [1, 1]],
                                                      "rho": 0.5}).content)
    assert out["kept_indices"] == [1, 3] and out["n_kept"] == 2
    assert "NaN" in call("ziprerank_prune_patches", {"text_embeddings": [[float("nan"), 0.0]],
                                                     "patch_embeddings": [[0.0, 1.0]]}).error
    assert "same D" in call("ziprerank_prune_patches", {"text_embeddings": [[1.0, 0.0]],
                                                        "patch_embeddings": [[0.0, 1.0, 2.0]]}).error
    losses = json.loads(call("ziprerank_losses", {"scores": [0.1, 2.0, -1.0], "relevant": [1]}).content)
    assert sum(losses["soft_targets"]) == pytest.approx(1.0) and losses["ranknet_loss"] > 0
    assert "outside" in call("ziprerank_losses", {"scores": [0.1, 2.0], "relevant": [5]}).error


# ------------------------------------------------------------------- a tiny Qwen2-VL, built here

VL_TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
               "{%- if message.content is string %}{{- message.content }}{%- else %}{%- for c in message.content %}"
               "{%- if c.type == 'text' %}{{- c.text }}{%- elif c.type == 'image' %}"
               "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}{%- endif %}"
               "{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
               "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


class TinyVLProcessor:
    """Stands in for Qwen2VLProcessor (whose video half needs torchvision, not installed here):
    the same chat template call, real Qwen2-VL image preprocessing, image pads expanded per grid."""

    def __init__(self, tokenizer, image_processor, merge: int = 2) -> None:
        self.tokenizer, self.image_processor, self.merge = tokenizer, image_processor, merge
        self.pad_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")

    def apply_chat_template(self, conversations, *, tokenize, add_generation_prompt, return_dict, return_tensors):
        assert tokenize and return_dict and return_tensors == "pt"
        msgs = conversations[0]
        text = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  chat_template=VL_TEMPLATE)
        images = [c["image"] for m in msgs for c in m["content"] if c["type"] == "image"]
        px = self.image_processor(images=images, return_tensors="pt")
        parts = text.split("<|image_pad|>")
        assert len(parts) == len(images) + 1
        out = parts[0]
        for thw, rest in zip(px["image_grid_thw"], parts[1:]):
            out += "<|image_pad|>" * (int(thw.prod()) // self.merge ** 2) + rest
        enc = self.tokenizer(out, return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                "mm_token_type_ids": (enc["input_ids"] == self.pad_id).long(),
                "pixel_values": px["pixel_values"], "image_grid_thw": px["image_grid_thw"]}


@pytest.fixture(scope="module")
def tiny_vlm(tiny_model_path):
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    tok.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                          "<|video_pad|>"]})
    ids = {n: tok.convert_tokens_to_ids(f"<|{n}|>") for n in ("vision_start", "vision_end", "image_pad", "video_pad")}
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=tok.eos_token_id,
                         eos_token_id=tok.eos_token_id, rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids["image_pad"], video_token_id=ids["video_pad"],
        vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"])
    model = Qwen2VLForConditionalGeneration(cfg).eval()
    proc = TinyVLProcessor(tok, Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56))
    return model, tok, proc


def pages(n, seed=0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray((rng.random((56, 56, 3)) * 255).astype("uint8")) for _ in range(n)]


def test_vlm_pages_one_forward_per_window_scores_follow_the_images(tiny_vlm):
    model, tok, proc = tiny_vlm
    rr = ListwiseReranker(model, tok, window=4, stride=2, processor=proc)
    imgs = pages(6)
    counter = CountForwards(model)
    try:
        perm, scores = rr.rerank("find the chart", imgs[:4])
        assert counter.n == 1 and sorted(perm) == [0, 1, 2, 3]
        perm6, _ = rr.rerank("find the chart", imgs)
        assert counter.n == 1 + n_windows(6, 4, 2) and sorted(perm6) == list(range(6))
    finally:
        counter.handle.remove()
    # Another page in slot C changes the scores: the model sees the pixels.
    other = rr.score_window("find the chart", imgs[:2] + pages(1, seed=9) + imgs[3:4])
    assert not torch.allclose(other, torch.tensor(scores))


def test_qi_ei_on_the_vlm_patch_embeddings(tiny_vlm):
    model, tok, proc = tiny_vlm
    inputs = proc.apply_chat_template([[{"role": "user", "content": [{"type": "image", "image": pages(1)[0]}]}]],
                                      tokenize=True, add_generation_prompt=False, return_dict=True, return_tensors="pt")
    with torch.no_grad():
        feats = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        patches = (feats.pooler_output if hasattr(feats, "pooler_output") else feats)
        patches = torch.cat(list(patches)) if isinstance(patches, (list, tuple)) else patches
        text = model.get_input_embeddings()(tok("find the chart", return_tensors="pt")["input_ids"][0])
    n = patches.shape[0]
    kept, idx = qi_ei_prune(text, patches, 0.5)
    assert len(idx) == max(1, round(0.5 * n)) and torch.all(idx[1:] > idx[:-1])
    assert torch.equal(qi_ei_prune(text, patches, 1.0)[0], patches)


# ------------------------------------------------------------------ end to end with a VLM checkpoint


def test_vlm_checkpoint_through_from_spec_and_the_tools(tiny_vlm_path, tmp_path):
    """``hf:DIR`` of a real VLM checkpoint (the tiny LLaVA, loaded with AutoProcessor as any VLM
    is): one forward per window over page images, through the library and through the tools."""
    import json

    from closedloop.tools.ziprerank import ziprerank_evaluate, ziprerank_rerank

    rr = ListwiseReranker.from_spec(f"hf:{tiny_vlm_path}", window=4, stride=2)
    assert rr.reads_images
    imgs = pages(6)
    counter = CountForwards(rr.model)
    try:
        perm, scores = rr.rerank("find the chart", imgs[:4])
        assert counter.n == 1 and sorted(perm) == [0, 1, 2, 3] and len(scores) == 4
    finally:
        counter.handle.remove()
    other = rr.score_window("find the chart", imgs[:2] + pages(1, seed=9) + imgs[3:4])
    assert not torch.allclose(other, torch.tensor(scores))  # the pixels reach the scores

    files = []
    for i, img in enumerate(imgs):
        files.append(f"page{i}.png")
        img.save(tmp_path / files[-1])
    out = asyncio.run(ziprerank_rerank.run({"model": f"hf:{tiny_vlm_path}", "query": "find the chart",
                                            "candidates": [str(tmp_path / f) for f in files[:4]], "window": 4,
                                            "stride": 2}))
    assert out.ok, out.content
    assert json.loads(out.content)["permutation"] == perm
    (tmp_path / "set.jsonl").write_text(json.dumps({"query": "find the chart", "candidates": files,
                                                    "relevant": [1]}) + "\n")
    out = asyncio.run(ziprerank_evaluate.run({"model": f"hf:{tiny_vlm_path}", "ranking_set": str(tmp_path / "set.jsonl"),
                                              "ks": [1, 3], "window": 4, "stride": 2}))
    assert out.ok, out.content
    report = json.loads(out.content)
    assert report["n_forwards"] == n_windows(6, 4, 2) and report["first_stage"]["recall@3"] == 1.0
    missing = asyncio.run(ziprerank_rerank.run({"model": f"hf:{tiny_vlm_path}", "query": "q",
                                                "candidates": [str(tmp_path / "nope.png")]}))
    assert not missing.ok and "page image not found" in missing.content
