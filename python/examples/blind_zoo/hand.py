"""Hand-built inputs: each bug against the correct kernel (max |diff| over all returned tensors)."""
import numpy as np, warnings, json, sys
warnings.filterwarnings("ignore")
from attn import make
from ce import make_ce, make_lce
from packshard import testing

def maxdiff(a, b):
    worst = 0.0; where = None
    for k in a:
        if k not in b: continue
        x = np.asarray(a[k], np.float64); y = np.asarray(b[k], np.float64)
        bothinf = (x == y)
        dd = np.where(bothinf, 0.0, np.abs(x - y))
        dd = np.where(np.isnan(dd), np.inf, dd)
        m = float(np.max(dd)) if dd.size else 0.0
        if m > worst: worst, where = m, k
    return worst, where

def attn_case(lq, lk=None, h=1, h_kv=1, d=8, causal=False, seed=0, scale="default", **opts):
    rng = np.random.default_rng(seed)
    lk = lk or lq
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int64)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int64)
    nq, nk = int(cu_q[-1]), int(cu_k[-1])
    a = dict(q=rng.standard_normal((nq, h, d)), k=rng.standard_normal((nk, h_kv, d)),
             v=rng.standard_normal((nk, h_kv, d)), grad_output=rng.standard_normal((nq, h, d)),
             cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, cu_seqlens=cu_q, max_seqlen_q=int(max(lq)),
             max_seqlen_k=int(max(lk)), causal=causal, want_grad=True,
             scale=(1 / np.sqrt(d) if scale == "default" else scale))
    a.update(opts)
    return a

def big_scores(lq, d=1, tiles_hi=(1,)):
    a = attn_case([lq], d=d, scale=1.0)
    a["q"][:] = 10.0
    a["k"][:] = 0.0
    for t in tiles_hi:
        a["k"][t * 64:(t + 1) * 64] = 10.0          # score 100 in key tile t
    return a

A = {}
A["causal_offset_max_seqlen"] = attn_case([5, 8], [9, 8], causal=True)
A["causal_skip_block_start"] = attn_case([100], [133], causal=True)
A["seqused_alignment_full_lk"] = attn_case([20], causal=True, seqused_k=np.array([12]))
A["gqa_grad_last_head"] = attn_case([7], h=4, h_kv=2)
A["delta_head0"] = attn_case([7], h=2)
A["dq_overwrite_per_tile"] = attn_case([100])
A["lse_without_max"] = attn_case([7], scale=3.0)
A["stale_max"] = big_scores(128)
A["no_max_subtraction"] = big_scores(8, tiles_hi=(0,))
A["l_fp16"] = attn_case([2048], d=4, scale=0.01)
A["mask_fill_minus_1e4"] = attn_case([6], [3], causal=True)
A["softcap_before_scale"] = attn_case([9], softcap=5.0, scale=0.2)
A["alibi_kv_head"] = attn_case([9], h=4, h_kv=2, alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625]))
A["scale_from_padded_d"] = attn_case([9], d=12, scale=None)
A["split_kv_floor"] = attn_case([1089])
A["p_bf16"] = attn_case([300])
A["hdim_gt128_second_half_unscaled"] = attn_case([9], d=192)
a = big_scores(128); a["grad_output"] = None; a["want_grad"] = False
a["k"][64:] = 2.0; A["inference_path_no_rescale"] = a

def ce_case(n, v, seed=0, w=None, **opts):
    rng = np.random.default_rng(seed)
    w = w or v
    a = dict(logits=rng.standard_normal((n, w)) * 2, targets=rng.integers(0, v, n).astype(np.int64),
             ignore_index=-100, label_smoothing=0.0, smoothing="pytorch", z_loss=0.0,
             reduction="mean", vocab_size=v, want_grad=True)
    a.update(opts)
    return a

C = {}
C["smoothing_megatron_as_pytorch"] = ce_case(4, 10, label_smoothing=0.2, smoothing="megatron")
c = ce_case(4, 10, z_loss=0.1); c["targets"][1] = -100; C["zloss_on_ignored"] = c
C["zloss_grad_missing"] = ce_case(4, 10, z_loss=0.1)
c = ce_case(2, 2048); c["logits"][:, 1500] = 20.0; C["chunk_merge_no_rescale"] = c
c = ce_case(4, 10, ignore_index=-1); c["targets"][2] = -1; C["ignore_only_minus100"] = c
c = ce_case(3, 10, softcap=5.0); c["logits"][0, 3] = -np.inf; C["softcap_neg_inf_becomes_minus_cap"] = c
c = ce_case(3, 10); c["logits"][1, 2] = 100.0; C["no_max_subtraction"] = c
c = ce_case(3, 10); c["targets"][0] = 9; C["target_chunk_off_by_one"] = c
c = ce_case(4, 10); c["targets"][1] = -100; C["ignored_rows_grad_not_zeroed"] = c
C["softcap_grad_no_chain"] = ce_case(3, 10, softcap=2.0)
C["sum_exp_fp16"] = ce_case(4, 3000, seed=5)
c = ce_case(2, 20000); c["logits"][:, 17000] = 20.0; C["chunk16k_merge_no_rescale"] = c

def lce_case(n, v, hd=8, seed=0, **opts):
    rng = np.random.default_rng(seed)
    a = dict(hidden=rng.standard_normal((n, hd)), weight=rng.standard_normal((v, hd)) * 0.5,
             targets=rng.integers(0, v, n).astype(np.int64), ignore_index=-100,
             label_smoothing=0.0, smoothing="pytorch", z_loss=0.0, reduction="mean",
             vocab_size=v, want_grad=True)
    a.update(opts)
    return a

L = {}
L["grad_weight_overwrite_token_chunk"] = lce_case(100, 50)
L["grad_hidden_drop_last_chunk"] = lce_case(4, 1500)
c = lce_case(4, 20); c["hidden"][0] *= 50; c["weight"][3] *= 50; L["logits_fp16"] = c
L["chunk_merge_no_rescale"] = lce_case(4, 2100, hd=16, seed=3)
L["grad_weight_overwrite_token_chunk_1024"] = lce_case(1500, 50)
c = lce_case(8, 64, hd=8); c["targets"][:3] = -100; L["per_chunk_mean"] = c

def main():
  out = {}
  for fam, cases, mk in (("attention", A, make), ("cross_entropy", C, make_ce), ("linear_cross_entropy", L, make_lce)):
      good = mk(None)
      for bug, args in cases.items():
          a = {k: (x.copy() if isinstance(x, np.ndarray) else x) for k, x in args.items()}
          g = good(**{k: (x.copy() if isinstance(x, np.ndarray) else x) for k, x in a.items()})
          b = mk(bug)(**{k: (x.copy() if isinstance(x, np.ndarray) else x) for k, x in a.items()})
          md, key = maxdiff(g, b)
          # the correct kernel passes the judge on this hand case
          ja = {k: x for k, x in a.items() if not (fam == "attention" and k in ("cu_seqlens", "max_seqlen_q", "max_seqlen_k"))}
          try:
              rg = testing.judge(fam, ja, g).passed
              rb = testing.judge(fam, ja, b).passed
          except Exception as e:
              rg = rb = f"judge error: {e}"
          print(f"{fam:22s} {bug:36s} max diff {md:.3e} in {key}; judge: correct {rg}, buggy {rb}")
          out[f"{fam}/{bug}"] = dict(maxdiff=md, tensor=key, correct_passes=rg, buggy_passes=rb)
  json.dump(out, open("hand_results.json", "w"), indent=1, default=str)

if __name__ == "__main__":
    main()
