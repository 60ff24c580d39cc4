"""Type stubs of packshard._native, the PyO3 module (python/src/py.rs).

Tensors are float64 numpy arrays (any strides; float32 for attention_f32),
integer arguments int64 arrays; results are dicts of float64 arrays (float32
from attention_f32), ints, strings and JSON values.
Every function raises PackshardError for bad input and for a panic inside
the native code (``kind == "internal"``).
"""

from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import numpy.typing as npt

__version__: str

F64 = npt.NDArray[np.float64]
F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]

class PackshardError(ValueError):
    kind: str
    field: Optional[str]
    index: Optional[int]
    message: str

def attention(q: F64, k: F64, v: F64, cu_seqlens: I64, causal: bool, scale: Optional[float],
              grad_output: Optional[F64], imp: str,
              cu_seqlens_k: Optional[I64] = None) -> Dict[str, Any]: ...
def attention_f32(q: F32, k: F32, v: F32, cu_seqlens: I64, causal: bool,
                  scale: Optional[float], grad_output: Optional[F32], imp: str,
                  cu_seqlens_k: Optional[I64] = None) -> Dict[str, F32]: ...
def time_attention_f32(q: F32, k: F32, v: F32, cu_seqlens: I64, causal: bool,
                       grad_output: Optional[F32], reps: int) -> List[float]: ...
def attention_judged(q: F64, k: F64, v: F64, cu_seqlens: I64, causal: bool,
                     scale: Optional[float], grad_output: Optional[F64], precision: str,
                     cu_seqlens_k: Optional[I64] = None
                     ) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]: ...
def time_attention(q: F64, k: F64, v: F64, cu_seqlens: I64, grad_output: F64, imp: str,
                   reps: int) -> List[float]: ...
def cross_entropy(logits: F64, targets: I64, options: Dict[str, Any], want_grad: bool,
                  imp: str) -> Dict[str, Any]: ...
def linear_cross_entropy(hidden: F64, weight: F64, targets: I64, options: Dict[str, Any],
                         want_grad: bool, imp: str) -> Dict[str, Any]: ...
def loss_judged(logits: Optional[F64], hidden: Optional[F64], weight: Optional[F64],
                targets: I64, options: Dict[str, Any], want_grad: bool, precision: str
                ) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]: ...
def embedding(ids: I64, weight: F64, vocab_size: Optional[int], num_shards: Optional[int],
              layout: Optional[str], grad_output: Optional[F64], imp: str) -> Dict[str, Any]: ...
def eval_json(case: str) -> str: ...
def cases(op: str, n: int, seed: int, large: Optional[int] = None
          ) -> List[Tuple[Dict[str, Any], str, int, int]]: ...
def judge_tensor(what: str, expected: F64, baseline: Optional[F64], actual: F64,
                 precision: str, scale: Optional[float] = None) -> Dict[str, Any]: ...
def round_to(x: F64, precision: str) -> F64: ...
def check_precision(precision: str) -> str: ...
def registry_list() -> List[Dict[str, Any]]: ...
def _panic_probe() -> None: ...
def collator_json(request: str, mask: Optional[F64] = None) -> str:
    """The collator check (python/src/collator.rs): a JSON request, a JSON
    answer (``{"error"}`` for a bad request, never raised)."""
    ...
