"""The Python bug zoo: numpy kernels with one realistic mistake each, beside their correct twins.

``ZOO`` maps each kernel's name to ``(op, kernel, what it gets wrong)``; the
correct twins are ``CORRECT`` (op -> kernel). ``python -m zoo`` (from
``python/examples``) runs every one through its op's default ``check_*``
call and prints which are caught; ``python/tests/test_zoo.py`` asserts it.
"""

from . import attention, cross_entropy

ZOO = {
    "attention_no_rescale": (
        "attention", attention.kernel("no_rescale"),
        "online softmax not rescaled when a later 16-key tile raises the row max"),
    "attention_partial_tile_unmasked": (
        "attention", attention.kernel("partial_tile_unmasked"),
        "the last key tile zero-padded to 16 keys, the padding not masked"),
    "attention_gqa_modulo": (
        "attention", attention.kernel("gqa_modulo"),
        "query head a reads key head a % h_kv instead of a // (h / h_kv)"),
    "attention_causal_top_left": (
        "attention", attention.kernel("causal_top_left"),
        "causal mask aligned top-left when a segment has fewer queries than keys"),
    "attention_lse_log2": (
        "attention", attention.kernel("lse_log2"), "lse returned in base 2"),
    "attention_delta_per_tile": (
        "attention", attention.kernel("delta_per_tile"),
        "the backward's D = rowsum(dO * O) from each key tile's partial output"),
    "attention_window_off_by_one": (
        "attention", attention.kernel("window_off_by_one"),
        "W1: the window's left edge one key too far (c >= r + l_k - l_q - left - 1)"),
    "attention_window_top_left": (
        "attention", attention.kernel("window_top_left"),
        "W2: the window aligned top-left (c = r) when a segment has l_q != l_k"),
    "attention_window_across_documents": (
        "attention", attention.kernel("window_across_documents"),
        "W3: the window's left edge over the pack's keys, into the previous document"),
    "attention_softcap_after_mask": (
        "attention", attention.kernel("softcap_after_mask"),
        "W4: softcap applied after the mask (a masked key scores -softcap, not -inf)"),
    "attention_softcap_no_chain": (
        "attention", attention.kernel("softcap_no_chain"),
        "W5: the score softcap's gradient without its 1 - tanh^2 chain factor"),
    "attention_alibi_pack_start": (
        "attention", attention.kernel("alibi_pack_start"),
        "W6: ALiBi's distance over the pack's token indices, not the segment's aligned ones"),
    "attention_alibi_sign": (
        "attention", attention.kernel("alibi_sign"), "W6: ALiBi's bias +slope |i - j|"),
    "attention_sum_f16": (
        "attention", attention.kernel("sum_f16"),
        "the softmax denominator accumulated in float16 (an f32 kernel's register in half)"),
    "attention_p_bf16": (
        "attention", attention.kernel("p_bf16"),
        "P rounded to bfloat16 before P V in an f32 kernel"),
    "ce_drop_last_chunk": (
        "cross_entropy", cross_entropy.kernel("drop_last_chunk"),
        "v // 1024 vocabulary chunks: the last partial chunk left out of the logsumexp"),
    "ce_ignore_in_mean": (
        "cross_entropy", cross_entropy.kernel("ignore_in_mean"),
        "the mean divides by every token, ignore_index ones included"),
    "ce_smoothing_padded": (
        "cross_entropy", cross_entropy.kernel("smoothing_padded"),
        "label smoothing spread over the padded width w instead of v"),
    "ce_grad_output_scalar": (
        "cross_entropy", cross_entropy.kernel("grad_output_scalar"),
        "a per-token grad_output (reduction none) read as one scalar"),
    "ce_softcap_no_chain": (
        "cross_entropy", cross_entropy.kernel("softcap_no_chain"),
        "the softcap's gradient without its 1 - tanh^2 chain factor"),
}

CORRECT = {
    "attention": attention.kernel(None),
    "cross_entropy": cross_entropy.kernel(None),
}
