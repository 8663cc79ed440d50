"""A model served on a CPU multiplies its linear layers through weights packed once for oneDNN
(serve/executor/packed_linear.py): the products equal the plain ones to rounding, the parameters are the
same objects under the same names, and a served model decodes the tokens the unpacked one does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardyard.models.kv_layout import BLOCK_TOKENS, CacheStep
from shardyard.serve.executor.packed_linear import ENV, PackedLinear, pack_linears, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN linear operators")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_linear_multiplies_as_the_plain_one_does(dtype: torch.dtype, bias: bool) -> None:
    """Where this CPU cannot lay a bfloat16 weight out for oneDNN (no AVX-512 nor AVX-NE-CONVERT:
    an AVX2 machine), the linear stays plain and serves as it was."""
    torch.manual_seed(0)
    plain = nn.Linear(96, 200, bias=bias).to(dtype)
    try:
        packed = PackedLinear(plain)
    except RuntimeError as err:
        assert dtype == torch.bfloat16 and "bf16 path needs the cpu support" in str(err)
        holder = nn.Sequential(plain)
        assert pack_linears(holder)[0] is plain  # kept plain, and it multiplies as before
        x = torch.randn(5, 96).to(dtype)
        torch.testing.assert_close(holder(x), F.linear(x, plain.weight, plain.bias))
        return
    inputs = [torch.randn(rows, 96) for rows in (1, 5, 16, 128, 700)]
    inputs += [torch.randn(3, 7, 96), torch.randn(40, 2, 96)[:, 1]]  # a batch of rows; rows not contiguous
    for x in inputs:
        x = x.to(dtype)
        got = packed(x)
        assert got.shape == F.linear(x, plain.weight, plain.bias).shape and got.dtype == dtype
        # Only the order of the additions may differ (bfloat16 rounds its result once more).
        tolerance = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
        torch.testing.assert_close(got, F.linear(x, plain.weight, plain.bias), **tolerance)
    assert packed.weight is plain.weight and packed.bias is plain.bias


@pytest.mark.timeout(60)
def test_packing_keeps_the_parameters_their_names_and_tied_weights() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from helpers.models import LLAMA
    keys = {k: v for k, v in LLAMA.items() if k != "architecture"} | {"tie_word_embeddings": True}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **keys)).eval()
    linears = sum(type(m) is nn.Linear for m in model.modules())
    before = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
    assert pack_linears(model) is model
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == linears > 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    after = dict(model.named_parameters(remove_duplicate=False))
    assert after.keys() == before.keys() and all(after[name] is before[name] for name in before)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied


@pytest.mark.timeout(120)
def test_a_model_served_in_the_replica_is_packed_and_decodes_as_the_unpacked_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LocalModel (a model decoded in the replica's process) packs its linears; its logits over a
    prompt and a batch of cached decode steps equal those of the same model unpacked
    (`SHARDYARD_PACKED_LINEAR=0`) to rounding, and greedy picks are the same."""
    from shardyard.serve.executor.local_model import LocalModel
    from helpers.models import LLAMA, save_llama
    torch.manual_seed(3)
    save_llama(tmp_path / "llama", initializer_range=0.5)
    blocks = 2 * (LLAMA["max_position_embeddings"] // BLOCK_TOKENS)
    tables = (tuple(range(0, blocks // 2)), tuple(range(blocks // 2, blocks)))
    prompts = torch.randint(0, LLAMA["vocab_size"], (2, 12))

    def decode(model: LocalModel) -> list[torch.Tensor]:
        """Logits of both prompts (one pass each) and of three decode steps of both rows at once."""
        out = [model.forward(prompts[row:row + 1], CacheStep(tables=(tables[row],), starts=(0,)))
               for row in range(2)]
        tokens = torch.cat(out).argmax(-1)
        for position in range(12, 15):
            logits = model.forward(tokens, CacheStep(tables=tables, starts=(position, position)))
            out.append(logits)
            tokens = logits.argmax(-1)
        return out

    packed = LocalModel(str(tmp_path / "llama"), cache_blocks=blocks)
    monkeypatch.setenv(ENV, "0")
    plain = LocalModel(str(tmp_path / "llama"), cache_blocks=blocks)
    try:
        assert any(isinstance(m, PackedLinear) for m in packed.model.modules())
        assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())
        for got, expected in zip(decode(packed), decode(plain), strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
            assert torch.equal(got.argmax(-1), expected.argmax(-1))
    finally:
        packed.close()
        plain.close()
