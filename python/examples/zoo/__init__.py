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
