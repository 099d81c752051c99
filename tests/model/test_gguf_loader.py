"""GGUF loading: dequantization per type, llama.cpp q/k unpermute, names, shapes and errors.

Every GGUF file here is synthetic, written with `gguf.GGUFWriter` into a temporary directory."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")  # not on the GPU machine
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import quantize  # noqa: E402

from eaglekv.errors import ModelLoadError  # noqa: E402
from eaglekv.model.config import ModelConfig
from eaglekv.model.gguf_loader import dequantize, hf_name, load_gguf, unpermute
from eaglekv.model.llama import check_state_dict, expected_tensors
from eaglekv.model.loader import load_checkpoint, resolve_model_path

# tiny llama: hidden 64, 2 layers, 4 heads x 16, 2 kv heads, ffn 128, vocab 300
H, L, NH, NKV, FF, V = 64, 2, 4, 2, 128, 300
D = H // NH


# ---- helpers ------------------------------------------------------------------------------------
def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's q/k row permutation (HF -> GGUF)."""
    out, inp = w.shape
    return w.reshape(n_head, 2, out // n_head // 2, inp).swapaxes(1, 2).reshape(out, inp)


def write_gguf(path: Path, tensors, arch: str = "llama", meta=None) -> Path:
    """tensors: [(name, array, raw_dtype or None)]; meta(writer) adds key/values."""
    w = gguf.GGUFWriter(str(path), arch)
    if meta is not None:
        meta(w)
    for name, arr, raw in tensors:
        if raw is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_meta(vocab_in_tokens: bool = True, extra=None):
    def meta(w: gguf.GGUFWriter):
        w.add_block_count(L)
        w.add_context_length(256)
        w.add_embedding_length(H)
        w.add_feed_forward_length(FF)
        w.add_head_count(NH)
        w.add_head_count_kv(NKV)
        w.add_rope_freq_base(50000.0)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        if vocab_in_tokens:
            w.add_token_list([f"t{i}" for i in range(V)])
        else:
            w.add_vocab_size(V)
        if extra is not None:
            extra(w)
    return meta


def hf_weights(seed: int = 0, untied: bool = False) -> dict[str, np.ndarray]:
    """Random HF-layout float32 weights of the tiny llama, by GGUF name."""
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    w = {"token_embd.weight": f(V, H), "output_norm.weight": f(H)}
    if untied:
        w["output.weight"] = f(V, H)
    for i in range(L):
        p = f"blk.{i}."
        w.update({p + "attn_norm.weight": f(H), p + "ffn_norm.weight": f(H),
                  p + "attn_q.weight": f(NH * D, H), p + "attn_k.weight": f(NKV * D, H),
                  p + "attn_v.weight": f(NKV * D, H), p + "attn_output.weight": f(H, NH * D),
                  p + "ffn_gate.weight": f(FF, H), p + "ffn_up.weight": f(FF, H),
                  p + "ffn_down.weight": f(H, FF)})
    return w


def to_gguf_tensors(hf: dict[str, np.ndarray], permute: bool = True, quant: dict | None = None):
    """GGUF tensor list: q/k permuted the llama.cpp way, chosen tensors quantized."""
    out = []
    for name, arr in hf.items():
        if permute and name.endswith("attn_q.weight"):
            arr = llama_cpp_permute(arr, NH)
        elif permute and name.endswith("attn_k.weight"):
            arr = llama_cpp_permute(arr, NKV)
        qt = (quant or {}).get(name.split(".")[-2])
        out.append((name, quantize(arr, qt), qt) if qt is not None else (name, arr, None))
    return out


def read_one(path: Path):
    reader = gguf.GGUFReader(str(path))
    assert len(reader.tensors) == 1
    return reader.tensors[0]


def block_abs_max(x: np.ndarray, block: int) -> np.ndarray:
    """Per-block max |x| broadcast back to x's shape."""
    b = np.abs(x.reshape(-1, block)).max(1, keepdims=True)
    return np.broadcast_to(b, (b.shape[0], block)).reshape(x.shape)


def block_range(x: np.ndarray, block: int) -> np.ndarray:
    xb = x.reshape(-1, block)
    r = xb.max(1, keepdims=True) - xb.min(1, keepdims=True)
    return np.broadcast_to(r, xb.shape).reshape(x.shape)


def encode_q6_k(q: np.ndarray, scales: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Pack 6-bit values q [rows, 256] in [0, 64), int8 scales [rows, 16] and f16 d [rows] into
    Q6_K blocks (llama.cpp block_q6_K: ql[128], qh[64], scales[16], d), one block per row."""
    rows = q.shape[0]
    out = np.zeros((rows, 210), dtype=np.uint8)
    for r in range(rows):
        ql, qh = np.zeros(128, np.uint8), np.zeros(64, np.uint8)
        for e in range(256):
            half, rest = divmod(e, 128)
            j, lane = divmod(rest, 32)       # quarter j of 32 values within the half
            v = int(q[r, e])
            ql[half * 64 + lane + 32 * (j % 2)] |= (v & 0xF) << (4 * (j // 2))
            qh[half * 32 + lane] |= (v >> 4) << (2 * j)
        out[r, :128], out[r, 128:192] = ql, qh
        out[r, 192:208] = scales[r].astype(np.int8).view(np.uint8)
        out[r, 208:] = np.array([d[r]], dtype=np.float16).view(np.uint8)
    return out


# ---- dequantize per type -------------------------------------------------------------------------
X = np.random.default_rng(3).standard_normal((3, 256)).astype(np.float32)
X[1] *= 10.0          # rows of different scale, so a wrong per-block scale shows
X[2, :32] = 0.0       # an all-zero block

# type -> (relative tolerance per block, block size, "absmax" | "range")
QUANT_TOL = {
    "Q8_0": (1 / 127, 32, "absmax"),
    "Q4_0": (1 / 8 + 1e-3, 32, "absmax"),
    "Q5_0": (1 / 16 + 1e-3, 32, "absmax"),
    "Q4_1": (1 / 15 + 1e-3, 32, "range"),
    "Q5_1": (1 / 31 + 1e-3, 32, "range"),
}


def test_dequantize_f32_exact(tmp_path):
    """F32 comes back bit-exact, float32, in row-major (rows, cols) shape."""
    t = read_one(write_gguf(tmp_path / "f32.gguf", [("x", X, None)]))
    y = dequantize(t)
    assert y.dtype == torch.float32 and y.shape == (3, 256)
    assert np.array_equal(y.numpy(), X)


def test_dequantize_f16_exact(tmp_path):
    """F16 comes back as exactly the float16 values, widened to float32."""
    x16 = X.astype(np.float16)
    y = dequantize(read_one(write_gguf(tmp_path / "f16.gguf", [("x", x16, None)])))
    assert y.dtype == torch.float32 and y.shape == (3, 256)
    assert np.array_equal(y.numpy(), x16.astype(np.float32))


def test_dequantize_bf16(tmp_path):
    """BF16 equals torch's bfloat16 rounding of the input (round to nearest even)."""
    y = dequantize(read_one(write_gguf(tmp_path / "bf16.gguf", [("x", quantize(X, QT.BF16),
                                                                  QT.BF16)])))
    assert y.shape == (3, 256)
    want = torch.from_numpy(X).bfloat16().float()
    assert torch.equal(y, want)


@pytest.mark.parametrize("qtype", list(QUANT_TOL))
def test_dequantize_block_quants(tmp_path, qtype):
    """Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 round-trip within one quantization step per block."""
    tol, block, kind = QUANT_TOL[qtype]
    qt = QT[qtype]
    y = dequantize(read_one(write_gguf(tmp_path / f"{qtype}.gguf", [("x", quantize(X, qt), qt)])))
    assert y.dtype == torch.float32 and y.shape == (3, 256)
    y = y.numpy()
    scale = block_abs_max(X, block) if kind == "absmax" else block_range(X, block)
    err = np.abs(y - X)
    assert (err <= tol * scale + 1e-6).all(), f"max excess {(err - tol * scale).max()}"
    assert np.all(y[2, :32] == 0.0)  # zero block stays zero
    # not vacuous: the error is well below the signal
    assert np.abs(y - X).mean() < 0.1 * np.abs(X).mean()


def test_dequantize_q6_k(tmp_path):
    """Hand-packed Q6_K blocks (gguf cannot quantize Q6_K) decode to d * scale * (q - 32)."""
    rng = np.random.default_rng(5)
    rows = 2
    q = rng.integers(0, 64, size=(rows, 256))
    scales = rng.integers(-128, 128, size=(rows, 16))
    d = np.array([0.0123, -0.5], dtype=np.float16)
    blocks = encode_q6_k(q, scales, d)
    y = dequantize(read_one(write_gguf(tmp_path / "q6k.gguf", [("x", blocks, QT.Q6_K)])))
    assert y.shape == (rows, 256)
    want = (d.astype(np.float32)[:, None] * np.repeat(scales, 16, axis=1).astype(np.float32)
            * (q - 32).astype(np.float32))
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-6, atol=0)


def test_dequantize_1d(tmp_path):
    """A 1-D tensor (a norm weight) keeps its 1-D shape."""
    x = X[0, :64].copy()
    y = dequantize(read_one(write_gguf(tmp_path / "n.gguf", [("n", x, None)])))
    assert y.shape == (64,) and np.array_equal(y.numpy(), x)


def test_dequantize_result_is_writable_copy(tmp_path):
    """The returned tensor owns its memory: writing to it does not touch the file."""
    path = write_gguf(tmp_path / "w.gguf", [("x", X, None)])
    y = dequantize(read_one(path))
    y.add_(1.0)
    assert np.array_equal(dequantize(read_one(path)).numpy(), X)


def test_dequantize_unsupported_written_type(tmp_path):
    """A TQ1_0 tensor in the file raises ModelLoadError naming the tensor and the type."""
    t = read_one(write_gguf(tmp_path / "tq.gguf", [("blk.0.ffn_up.weight",
                                                     quantize(X, QT.TQ1_0), QT.TQ1_0)]))
    assert t.tensor_type == QT.TQ1_0
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_up\.weight has type TQ1_0, unsupported"):
        dequantize(t)


@pytest.mark.parametrize("qtype", ["IQ2_XXS", "Q2_K", "Q3_K", "F64", "I8"])
def test_dequantize_unsupported_type_patched(qtype):
    """Types outside SUPPORTED_TYPES raise ModelLoadError naming the type before any decode."""
    fake = SimpleNamespace(name="w", tensor_type=QT[qtype], data=np.zeros(4, np.uint8),
                           shape=np.array([4]))
    with pytest.raises(ModelLoadError, match=f"type {qtype}, unsupported"):
        dequantize(fake)


# ---- unpermute ----------------------------------------------------------------------------------
@pytest.mark.parametrize("n_head,out,inp", [(1, 4, 1), (4, 64, 64), (2, 32, 64), (3, 48, 5),
                                            (8, 16, 3)])
def test_unpermute_inverts_llama_cpp(n_head, out, inp):
    """unpermute(llama.cpp permute(w)) == w, and unpermute is not the identity."""
    w = np.random.default_rng(n_head).standard_normal((out, inp)).astype(np.float32)
    p = torch.from_numpy(llama_cpp_permute(w, n_head))
    assert torch.equal(unpermute(p, n_head), torch.from_numpy(w))
    if out // n_head > 2:
        assert not torch.equal(p, torch.from_numpy(w))


def test_unpermute_small_example():
    """One head of 4 rows: GGUF rows [0, 2, 1, 3] go back to [0, 1, 2, 3]."""
    w = torch.tensor([[0.0], [2.0], [1.0], [3.0]])
    assert unpermute(w, 1).flatten().tolist() == [0.0, 1.0, 2.0, 3.0]


def test_unpermute_depends_on_head_count():
    """Using the wrong head count (q's for k) gives a different result."""
    w = torch.arange(32 * 2, dtype=torch.float32).reshape(32, 2)
    assert not torch.equal(unpermute(w, 2), unpermute(w, 4))


# ---- names --------------------------------------------------------------------------------------
@pytest.mark.parametrize("gguf_name,hf", [
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("blk.11.attn_k.bias", "model.layers.11.self_attn.k_proj.bias"),
    ("blk.3.attn_output.weight", "model.layers.3.self_attn.o_proj.weight"),
    ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight"),
    ("blk.1.attn_k_norm.weight", "model.layers.1.self_attn.k_norm.weight"),
    ("rope_freqs.weight", None),
])
def test_hf_name(gguf_name, hf):
    """GGUF names map to Hugging Face names; rope_freqs is dropped."""
    assert hf_name(gguf_name) == hf


@pytest.mark.parametrize("bad", ["blk.0.attn_qkv.weight", "foo.weight", "blk.x.attn_q.weight",
                                 "blk.0.attn_q.scale"])
def test_hf_name_unknown(bad):
    """An unknown GGUF tensor name raises ModelLoadError naming it."""
    with pytest.raises(ModelLoadError, match=bad.replace(".", r"\.")):
        hf_name(bad)


# ---- load_gguf ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf():
    return hf_weights(seed=0)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory, hf):
    """A tied tiny llama GGUF, F32, q/k permuted the llama.cpp way."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return write_gguf(path, to_gguf_tensors(hf), meta=llama_meta())


@pytest.fixture(scope="module")
def loaded(model_file):
    return load_gguf(model_file)


def test_load_config(loaded):
    """The metadata becomes the right ModelConfig."""
    cfg, _ = loaded
    assert (cfg.model_type, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == \
        ("llama", V, H, FF)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (L, NH, NKV, D)
    assert cfg.max_position_embeddings == 256
    assert cfg.rms_norm_eps == pytest.approx(1e-5, rel=1e-6)
    assert cfg.tie_word_embeddings is True
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    assert not cfg.attention_bias and not cfg.qk_norm
    rope = cfg.hf_config.rope_parameters
    assert rope["rope_type"] == "default" and rope["rope_theta"] == pytest.approx(50000.0)


def test_load_names_and_shapes(loaded):
    """Every tensor comes back under its HF name with the shape the config expects."""
    cfg, sd = loaded
    want = expected_tensors(cfg)
    assert set(sd) == set(want)
    for name, shape in want.items():
        assert tuple(sd[name].shape) == shape, name
        assert sd[name].dtype == torch.float32
    check_state_dict(cfg, sd)


def test_load_unpermutes_q_and_k(loaded, hf):
    """q_proj / k_proj equal the HF weights again (each with its own head count); v is untouched."""
    _, sd = loaded
    for i in range(L):
        for g, h in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                     ("attn_output", "o_proj")):
            got = sd[f"model.layers.{i}.self_attn.{h}.weight"]
            assert np.array_equal(got.numpy(), hf[f"blk.{i}.{g}.weight"]), (i, h)


def test_load_values_of_other_tensors(loaded, hf):
    """Embedding, norms and MLP weights are copied value for value."""
    _, sd = loaded
    assert np.array_equal(sd["model.embed_tokens.weight"].numpy(), hf["token_embd.weight"])
    assert np.array_equal(sd["model.norm.weight"].numpy(), hf["output_norm.weight"])
    assert np.array_equal(sd["model.layers.1.mlp.down_proj.weight"].numpy(),
                          hf["blk.1.ffn_down.weight"])
    assert np.array_equal(sd["model.layers.0.post_attention_layernorm.weight"].numpy(),
                          hf["blk.0.ffn_norm.weight"])


def test_load_untied_quantized(tmp_path):
    """output.weight makes the model untied (lm_head present); Q8_0 MLP weights load close."""
    hf = hf_weights(seed=1, untied=True)
    quant = {"ffn_gate": QT.Q8_0, "ffn_up": QT.Q8_0, "ffn_down": QT.Q8_0, "attn_q": QT.Q8_0}
    path = write_gguf(tmp_path / "untied.gguf", to_gguf_tensors(hf, quant=quant),
                      meta=llama_meta(vocab_in_tokens=False))
    cfg, sd = load_gguf(path)
    assert cfg.tie_word_embeddings is False and cfg.vocab_size == V
    check_state_dict(cfg, sd)
    assert np.array_equal(sd["lm_head.weight"].numpy(), hf["output.weight"])
    for name, g in (("model.layers.0.mlp.up_proj.weight", "blk.0.ffn_up.weight"),
                    ("model.layers.1.self_attn.q_proj.weight", "blk.1.attn_q.weight")):
        x = hf[g]
        err = np.abs(sd[name].numpy() - x)
        assert (err <= block_abs_max(x, 32) / 127 + 1e-6).all(), name  # unpermuted after dequant


def test_load_ignores_rope_freqs(tmp_path):
    """A rope_freqs.weight tensor is skipped, not reported as unknown."""
    tensors = to_gguf_tensors(hf_weights()) + [("rope_freqs.weight", np.ones(D // 2, np.float32),
                                                None)]
    cfg, sd = load_gguf(write_gguf(tmp_path / "rf.gguf", tensors, meta=llama_meta()))
    assert not any("rope" in n for n in sd)
    check_state_dict(cfg, sd)


def test_load_linear_rope_scaling(tmp_path):
    """llama.rope.scaling.type=linear reaches the config with its factor."""
    def extra(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)
    cfg, _ = load_gguf(write_gguf(tmp_path / "lin.gguf", to_gguf_tensors(hf_weights()),
                                  meta=llama_meta(extra=extra)))
    rope = cfg.hf_config.rope_parameters
    assert rope["rope_type"] == "linear" and rope["factor"] == pytest.approx(4.0)


def test_load_unsupported_rope_scaling(tmp_path):
    """An unsupported rope scaling (yarn) raises ModelLoadError naming it."""
    def extra(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    path = write_gguf(tmp_path / "yarn.gguf", to_gguf_tensors(hf_weights()),
                      meta=llama_meta(extra=extra))
    with pytest.raises(ModelLoadError, match="rope scaling 'yarn'"):
        load_gguf(path)


def test_load_unknown_tensor(tmp_path):
    """A GGUF tensor with no HF counterpart raises ModelLoadError naming it."""
    tensors = to_gguf_tensors(hf_weights()) + [("blk.0.attn_sinks.weight",
                                                np.ones(NH, np.float32), None)]
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_sinks\.weight"):
        load_gguf(write_gguf(tmp_path / "unk.gguf", tensors, meta=llama_meta()))


@pytest.mark.parametrize("arch", ["gpt2", "phi3"])
def test_load_unsupported_architecture(tmp_path, arch):
    """general.architecture outside llama / qwen2 / qwen3 raises ModelLoadError naming it."""
    def meta(w):
        w.add_token_list([f"t{i}" for i in range(V)])
    path = write_gguf(tmp_path / f"{arch}.gguf", [("token_embd.weight", np.zeros((V, H),
                                                                              np.float32), None)],
                      arch=arch, meta=meta)
    with pytest.raises(ModelLoadError, match=f"architecture '{arch}'"):
        load_gguf(path)


def test_load_qwen2_not_unpermuted(tmp_path):
    """qwen2 GGUFs are stored unpermuted: q/k come back exactly as written."""
    hf = hf_weights(seed=2)
    for i in range(L):
        for g, n in (("attn_q", NH * D), ("attn_k", NKV * D), ("attn_v", NKV * D)):
            hf[f"blk.{i}.{g}.bias"] = np.random.default_rng(i).standard_normal(n).astype(np.float32)

    def meta(w):
        w.add_block_count(L)
        w.add_embedding_length(H)
        w.add_feed_forward_length(FF)
        w.add_head_count(NH)
        w.add_head_count_kv(NKV)
        w.add_vocab_size(V)
    cfg, sd = load_gguf(write_gguf(tmp_path / "qwen2.gguf", to_gguf_tensors(hf, permute=False),
                                   arch="qwen2", meta=meta))
    assert cfg.model_type == "qwen2" and cfg.attention_bias
    check_state_dict(cfg, sd)
    assert np.array_equal(sd["model.layers.1.self_attn.q_proj.weight"].numpy(),
                          hf["blk.1.attn_q.weight"])
    assert np.array_equal(sd["model.layers.0.self_attn.k_proj.bias"].numpy(),
                          hf["blk.0.attn_k.bias"])


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all, just some text bytes...."])
def test_load_not_gguf(tmp_path, content):
    """An empty or non-GGUF file raises ModelLoadError naming the file."""
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="bad.gguf is not a readable GGUF file"):
        load_gguf(path)


@pytest.mark.parametrize("cut", [16, 200, 4000, "half", "tail"])
def test_load_truncated(model_file, tmp_path, cut):
    """A truncated GGUF raises ModelLoadError, also when cut inside the key/value metadata
    (where GGUFReader raises IndexError)."""
    data = model_file.read_bytes()
    n = {"half": len(data) // 2, "tail": len(data) - 100}.get(cut, cut)
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:n])
    with pytest.raises(ModelLoadError):
        load_gguf(path)


def test_load_checkpoint_gguf(model_file, loaded):
    """load_checkpoint on a .gguf path returns the same config and weights as load_gguf."""
    ck = load_checkpoint(model_file, load_tokenizer=False)
    assert ck.source == str(model_file) and ck.tokenizer is None
    cfg, sd = loaded
    assert ck.config == cfg and set(ck.state_dict) == set(sd)
    assert all(torch.equal(ck.state_dict[n], sd[n]) for n in sd)


# ---- check_state_dict ---------------------------------------------------------------------------
@pytest.fixture
def cfg() -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=V, hidden_size=H, intermediate_size=FF,
                       num_layers=L, num_heads=NH, num_kv_heads=NKV, head_dim=D,
                       rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=True,
                       attention_bias=False, qk_norm=False)


@pytest.fixture
def good_sd(cfg):
    return {n: torch.zeros(s) for n, s in expected_tensors(cfg).items()}


def test_check_state_dict_ok(cfg, good_sd):
    """A complete state dict with the right shapes passes (tied lm_head and inv_freq tolerated)."""
    check_state_dict(cfg, good_sd)
    good_sd["lm_head.weight"] = torch.zeros(V, H)
    good_sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(D // 2)
    check_state_dict(cfg, good_sd)


def test_check_state_dict_shape_mismatch(cfg, good_sd):
    """A wrong shape raises ModelLoadError naming the tensor and both shapes."""
    name = "model.layers.1.self_attn.k_proj.weight"
    good_sd[name] = torch.zeros(NH * D, H)   # q's shape where k's is expected (GQA mix-up)
    with pytest.raises(ModelLoadError) as e:
        check_state_dict(cfg, good_sd)
    msg = str(e.value)
    assert name in msg and str((NH * D, H)) in msg and str((NKV * D, H)) in msg


def test_check_state_dict_missing(cfg, good_sd):
    """A missing tensor raises ModelLoadError naming it and its expected shape."""
    del good_sd["model.layers.0.mlp.up_proj.weight"]
    msg = r"missing tensor model\.layers\.0\.mlp\.up_proj\.weight \(expected shape \(128, 64\)\)"
    with pytest.raises(ModelLoadError, match=msg):
        check_state_dict(cfg, good_sd)


def test_check_state_dict_missing_lm_head_untied(cfg, good_sd):
    """An untied config without lm_head.weight is rejected."""
    from dataclasses import replace
    with pytest.raises(ModelLoadError, match=r"lm_head\.weight"):
        check_state_dict(replace(cfg, tie_word_embeddings=False), good_sd)


def test_check_state_dict_extra(cfg, good_sd):
    """An unexplained extra tensor raises ModelLoadError naming it."""
    good_sd["model.layers.2.self_attn.q_proj.weight"] = torch.zeros(NH * D, H)
    with pytest.raises(ModelLoadError, match=r"1 unexpected.*model\.layers\.2"):
        check_state_dict(cfg, good_sd)


# ---- resolve_model_path -------------------------------------------------------------------------
def test_resolve_missing_path(tmp_path):
    """A path that does not exist raises ModelLoadError naming it."""
    missing = tmp_path / "nope" / "model.gguf"
    with pytest.raises(ModelLoadError, match=f"{missing} does not exist"):
        resolve_model_path(missing)


def test_resolve_file_and_single_gguf_dir(tmp_path):
    """A file resolves to itself; a directory with one .gguf and no config.json to that file."""
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    assert resolve_model_path(f) == f
    assert resolve_model_path(str(tmp_path)) == f


def test_resolve_hf_dir(tmp_path):
    """A directory with config.json resolves to the directory."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "a.gguf").write_bytes(b"x")
    assert resolve_model_path(tmp_path) == tmp_path


@pytest.mark.parametrize("n", [0, 2])
def test_resolve_ambiguous_dir(tmp_path, n):
    """A directory without config.json and with 0 or 2 .gguf files raises, with the count."""
    for i in range(n):
        (tmp_path / f"m{i}.gguf").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=f"no config.json \\(and {n} .gguf files\\)"):
        resolve_model_path(tmp_path)


@pytest.mark.parametrize("qt", [QT.Q8_0, QT.Q4_0, QT.Q4_1])
def test_fast_dequantize_is_bit_exact(qt):
    """The in-place Q8_0/Q4_0/Q4_1 path equals gguf.quants.dequantize bit for bit."""
    from gguf.quants import dequantize as gguf_dequantize
    x = np.random.default_rng(5).standard_normal((48, 96)).astype(np.float32) * 3
    raw = quantize(x, qt)
    t = SimpleNamespace(name="w", tensor_type=qt, shape=(96, 48), data=raw)
    assert np.array_equal(dequantize(t).numpy(), gguf_dequantize(raw, qt).reshape(48, 96))


def test_hf_gguf_load_parses_the_file_once(model_file, monkeypatch):
    """`bench.e2e.gguf_parsed_once` (the HF oracle's GGUF load, 31 -> 13 s for SmolLM2):
    transformers' loader reads the file once instead of twice and builds gguf's tensor-name
    table once; the model is the same as without it (config and every weight), and gguf's
    own functions are back after it, an error inside included."""
    import gguf
    from transformers import AutoModelForCausalLM

    from eaglekv.bench.e2e import gguf_parsed_once
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    opened, built = [], []
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a: opened.append(a) or reader(*a))
    monkeypatch.setattr(gguf, "get_tensor_name_map",
                        lambda *a: built.append(a) or name_map(*a))

    def load():
        return AutoModelForCausalLM.from_pretrained(model_file.parent, gguf_file=model_file.name,
                                                    dtype=torch.float32)
    plain = load()
    assert opened and built           # transformers 5.25: 2 parses, one table a module
    opened.clear()
    built.clear()
    with gguf_parsed_once():
        once = load()
    assert len(opened) == 1 and len(built) == 1
    assert once.config.to_dict() == plain.config.to_dict()
    a, b = once.state_dict(), plain.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    patched = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(RuntimeError, match="inside"), gguf_parsed_once():
        assert gguf.GGUFReader is not patched[0]
        raise RuntimeError("inside")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == patched
