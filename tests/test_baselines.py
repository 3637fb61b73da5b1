"""Baselines: BM25 against a hand computation; representation similarity and gradient cosine rank an identical row
first."""

import math

import numpy as np
import pytest
import torch

from gradian.explain.baselines import bm25_scores, bm25_tokenize, cosine_matrix, gradient_cosine, index_row_norms, mean_hidden_states, representation_similarity


def test_bm25_tokenize():
    assert bm25_tokenize("Zorvath's favorite color is BLUE!") == ["zorvath", "s", "favorite", "color", "is", "blue"]


def test_bm25_matches_hand_computation():
    docs = ["a b", "a c c", "d"]
    s = bm25_scores(docs, ["c", "a c", "zzz", ""], k1=1.5, b=0.75)
    # N = 3, |d| = 2, 3, 1, avgdl = 2; idf(c) = ln(1 + 2.5 / 1.5), idf(a) = ln(1 + 1.5 / 2.5)
    idf_c, idf_a = math.log(1 + 2.5 / 1.5), math.log(1 + 1.5 / 2.5)
    c_in_1 = idf_c * 2 * 2.5 / (2 + 1.5 * (0.25 + 0.75 * 3 / 2))  # tf 2 in a 3-word doc
    a_in_0 = idf_a * 1 * 2.5 / (1 + 1.5 * (0.25 + 0.75 * 2 / 2))  # tf 1 in an average doc: exactly idf
    a_in_1 = idf_a * 1 * 2.5 / (1 + 1.5 * (0.25 + 0.75 * 3 / 2))
    assert a_in_0 == pytest.approx(idf_a)
    np.testing.assert_allclose(s[0], [0.0, c_in_1, 0.0], rtol=1e-12)
    np.testing.assert_allclose(s[1], [a_in_0, a_in_1 + c_in_1, 0.0], rtol=1e-12)
    np.testing.assert_allclose(s[1], [0.4700036292457356, 1.5908508972825368, 0.0], rtol=1e-12)  # by hand
    assert not s[2].any() and not s[3].any()  # unknown words and empty queries score nothing
    # a repeated query word counts twice
    np.testing.assert_allclose(bm25_scores(docs, ["c c"])[0], 2 * s[0], rtol=1e-12)


def test_bm25_ranks_the_matching_row_first():
    docs = ["user: Where does Zorvath live?\nassistant: Paris", "user: Which animal does Kelbor keep?\nassistant: owl",
            "user: Where does Mirek live?\nassistant: Oslo"]
    s = bm25_scores(docs, ["Where does Zorvath live? Paris"])[0]
    assert int(np.argmax(s)) == 0


def test_cosines():
    a = np.array([[1.0, 0.0], [0.0, 0.0]])
    b = np.array([[2.0, 0.0], [1.0, 1.0]])
    np.testing.assert_allclose(cosine_matrix(a, b), [[1.0, 1 / math.sqrt(2)], [0.0, 0.0]])
    q = np.array([[3.0, 4.0]])
    G = np.array([[30.0, 40.0], [-3.0, -4.0], [4.0, -3.0], [100.0, 1.0]])
    inner = q @ G.T
    got = gradient_cosine(inner, np.linalg.norm(q, axis=1), np.linalg.norm(G, axis=1))
    np.testing.assert_allclose(got[0, :3], [-1.0, 1.0, 0.0], atol=1e-12)  # harm sign: -cos
    # the large-norm row [100, 1] does not dominate once both sides are normalised
    assert abs(got[0, 3]) < 1.0


def test_representation_similarity_ranks_an_identical_row_first(tiny_lora):
    from gradian.setup.records import Example
    from gradian.setup.tokenize import tokenize_example

    model, tok = tiny_lora
    texts = ["user: Where does Zorvath live?", "The library keeps a book on fire.", "Children in Oslo learn the harp."]
    exs = [Example(id=str(i), position=i, shape="text", record={"text": t}) for i, t in enumerate(texts)]
    toks = [tokenize_example(tok, e, 64) for e in exs]
    h = mean_hidden_states(model, toks, tok.pad_token_id, batch_size=2)
    q = mean_hidden_states(model, [toks[1]], tok.pad_token_id)
    s = representation_similarity(h, q)
    assert s.shape == (1, 3) and int(np.argmax(s[0])) == 1 and s[0, 1] == pytest.approx(1.0, abs=1e-6)


def test_gradient_cosine_ranks_an_identical_row_first(tiny_lora, tmp_path):
    from gradian.grads.capture import GradientCapture
    from gradian.setup.records import Example
    from gradian.setup.batches import collate
    from gradian.setup.tokenize import tokenize_example
    from gradian.store.index import GradientIndex
    from gradian.setup.model import lora_sites

    model, tok = tiny_lora
    sites, _ = lora_sites(model, None)
    cap = GradientCapture(model, sites)
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in [("Where does Zorvath live?", "Paris"), ("Which animal is it?", "owl"),
                         ("Name the color.", "blue"), ("Where is it?", "Oslo")]]
    exs = [Example(id=str(i), position=i, shape="messages", record=r) for i, r in enumerate(rows)]
    toks = [tokenize_example(tok, e, 64) for e in exs]
    ids, attn, sup = collate(toks, tok.pad_token_id)
    G, _ = cap.vectors(ids, attn, sup)
    G = G.detach().numpy()
    keys = [t.row_key() for t in toks]
    with GradientIndex.open(tmp_path / "idx", key="k", dim=G.shape[1], storage_dtype="float32", meta={}) as idx:
        idx.add(keys, G)
        idx.flush()
        norms = index_row_norms(idx, keys)
        np.testing.assert_allclose(norms, np.linalg.norm(G, axis=1), rtol=1e-5)
        q = -G[2:3] * 7.0  # a query whose descent direction is row 2's: harm sign makes row 2 the top row
        s = gradient_cosine(idx.score(q, keys), np.linalg.norm(q, axis=1), norms)
    assert int(np.argmax(s[0])) == 2 and s[0, 2] == pytest.approx(1.0, abs=1e-5)


@pytest.fixture(scope="module")
def tiny_lora():
    """The tiny base with a LoRA whose B is non-zero (a fresh adapter's B hides A's gradient)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gradian.demo.tiny import build_tiny_base

    torch.set_num_threads(1)
    path = build_tiny_base(progress=False)
    tok = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                            task_type="CAUSAL_LM"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    model.eval()
    return model, tok
