//! Tensors of the golden vectors: values, their stored dtype and bytes,
//! hashes and summaries, and reading any numeric safetensors dtype back as
//! f64.

use packshard_reference::precision::{self, Precision};
use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorView};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::GoldenError;

/// The float dtype golden inputs are stored in (`--dtype`): the workspace's
/// one precision type, [`Precision`], whose [`Precision::round`] rounds the
/// stored inputs (to nearest, ties to even; bf16 through f32, as the kernels
/// and PyTorch round) and whose [`Precision::unit_roundoff`] sizes the
/// low-precision rules.
pub type Dtype = Precision;

/// The `--dtype` choices, in order: `f64` (the default: inputs exactly as
/// the reference sees them), `f32`, `bf16`.
pub const DTYPES: [Dtype; 3] = [Precision::F64, Precision::F32, Precision::Bf16];

/// The `--dtype` called `s` (one of [`DTYPES`]).
///
/// # Errors
/// A [`GoldenError`] naming the dtype and the choices.
pub fn parse_dtype(s: &str) -> Result<Dtype, GoldenError> {
    DTYPES
        .into_iter()
        .find(|d| d.name() == s)
        .ok_or_else(|| GoldenError::new(format!("dtype: unknown {s:?}; expected f64, f32 or bf16")))
}

/// The safetensors dtype floats stored as `dtype` are written in.
fn safetensors_dtype(dtype: Dtype) -> StDtype {
    match dtype {
        Precision::F64 => StDtype::F64,
        Precision::F32 => StDtype::F32,
        Precision::Bf16 => StDtype::BF16,
        Precision::F16 => StDtype::F16,
    }
}

/// The safetensors dtype name of `dtype`: `F64`, `F32`, `BF16`, `F16`.
pub fn safetensors_name(dtype: Dtype) -> &'static str {
    match dtype {
        Precision::F64 => "F64",
        Precision::F32 => "F32",
        Precision::Bf16 => "BF16",
        Precision::F16 => "F16",
    }
}

/// `values` (already rounded to `dtype`) as stored, little-endian.
fn float_bytes(dtype: Dtype, values: &[f64]) -> Vec<u8> {
    match dtype {
        Precision::F64 => values.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Precision::F32 => values
            .iter()
            .flat_map(|&x| (x as f32).to_le_bytes())
            .collect(),
        Precision::Bf16 => values
            .iter()
            .flat_map(|&x| precision::to_bf16(x).to_bits().to_le_bytes())
            .collect(),
        Precision::F16 => values
            .iter()
            .flat_map(|&x| precision::to_f16(x).to_bits().to_le_bytes())
            .collect(),
    }
}

/// The values of a tensor: floats (stored in a [`Dtype`]) or integers
/// (stored as `I64`).
#[derive(Debug, Clone, PartialEq)]
pub enum Values {
    /// Float values, already rounded to the dtype they are stored in.
    F(Vec<f64>, Dtype),
    /// Integer values (token ids, targets, `cu_seqlens`, plans).
    I(Vec<i64>),
}

/// A named tensor, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    /// Its name within the case (`q`, `grad_logits`, ...).
    pub name: String,
    /// Extent of each dimension (`[]` for a scalar).
    pub shape: Vec<usize>,
    /// The values.
    pub values: Values,
}

impl Tensor {
    /// Floats stored as `dtype` (rounded to it here).
    pub fn float(name: &str, shape: &[usize], values: Vec<f64>, dtype: Dtype) -> Self {
        debug_assert_eq!(values.len(), shape.iter().product::<usize>());
        Tensor {
            name: name.into(),
            shape: shape.to_vec(),
            values: Values::F(values.into_iter().map(|x| dtype.round(x)).collect(), dtype),
        }
    }

    /// Integers (stored as `I64`).
    pub fn int(name: &str, shape: &[usize], values: Vec<i64>) -> Self {
        debug_assert_eq!(values.len(), shape.iter().product::<usize>());
        Tensor {
            name: name.into(),
            shape: shape.to_vec(),
            values: Values::I(values),
        }
    }

    /// The values as f64 (integers converted).
    pub fn as_f64(&self) -> Vec<f64> {
        match &self.values {
            Values::F(v, _) => v.clone(),
            Values::I(v) => v.iter().map(|&x| x as f64).collect(),
        }
    }

    /// The safetensors dtype name it is stored as.
    pub fn dtype_name(&self) -> &'static str {
        match &self.values {
            Values::F(_, d) => safetensors_name(*d),
            Values::I(_) => "I64",
        }
    }

    /// The stored bytes (little-endian, as in the file).
    pub fn bytes(&self) -> Vec<u8> {
        match &self.values {
            Values::F(v, d) => float_bytes(*d, v),
            Values::I(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    fn st_dtype(&self) -> StDtype {
        match &self.values {
            Values::F(_, d) => safetensors_dtype(*d),
            Values::I(_) => StDtype::I64,
        }
    }

    /// The manifest entry: dtype, shape, sha256 of the stored bytes, and a
    /// rounded summary.
    pub fn describe(&self) -> serde_json::Map<String, Value> {
        let mut m = serde_json::Map::new();
        m.insert("dtype".into(), json!(self.dtype_name()));
        m.insert("shape".into(), json!(self.shape));
        m.insert("sha256".into(), json!(sha256_hex(&self.bytes())));
        m.insert("summary".into(), summary(&self.as_f64()));
        m
    }
}

/// The hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `x` rounded to 6 significant digits (for summaries that stay stable
/// under round-off yet show a changed value).
pub fn round_sig(x: f64) -> f64 {
    format!("{x:.5e}").parse().unwrap_or(x)
}

/// `x` rounded *up* to 3 significant digits (for tolerances: never tighter
/// than derived).
pub fn round_up_sig(x: f64) -> f64 {
    if x <= 0.0 || !x.is_finite() {
        return x;
    }
    let e = x.log10().floor() as i32 - 2;
    let scale = 10f64.powi(e);
    let r = (x / scale).ceil() * scale;
    // Re-round the printed form so it reads as 3 digits, and stays >= x.
    let s: f64 = format!("{r:.2e}").parse().unwrap_or(r);
    if s >= x {
        s
    } else {
        r
    }
}

/// `{min, max, mean}` of the finite values, rounded to 6 significant
/// digits, and the count of non-finite ones when there are any.
pub fn summary(values: &[f64]) -> Value {
    let finite: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    let mut m = serde_json::Map::new();
    if !finite.is_empty() {
        let min = finite.iter().copied().fold(f64::INFINITY, f64::min);
        let max = finite.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mean = finite.iter().sum::<f64>() / finite.len() as f64;
        m.insert("min".into(), json!(round_sig(min)));
        m.insert("max".into(), json!(round_sig(max)));
        m.insert("mean".into(), json!(round_sig(mean)));
    }
    let nonfinite = values.len() - finite.len();
    if nonfinite > 0 {
        m.insert("nonfinite".into(), json!(nonfinite));
    }
    Value::Object(m)
}

/// A safetensors image of `tensors` (names as given).
///
/// # Errors
/// A [`GoldenError`] from the serializer (duplicate names).
pub fn serialize(tensors: &[Tensor]) -> Result<Vec<u8>, GoldenError> {
    let bytes: Vec<Vec<u8>> = tensors.iter().map(Tensor::bytes).collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|(t, b)| {
            TensorView::new(t.st_dtype(), t.shape.clone(), b)
                .map(|v| (t.name.clone(), v))
                .map_err(|e| GoldenError::new(format!("tensor {}: {e}", t.name)))
        })
        .collect::<Result<Vec<_>, _>>()?;
    safetensors::serialize(views, None).map_err(|e| GoldenError::new(e.to_string()))
}

/// A tensor read back: its stored dtype name, shape, raw bytes as f64
/// values, and whether the dtype is an integer one.
#[derive(Debug, Clone, PartialEq)]
pub struct Loaded {
    /// The safetensors dtype name (`F32`, `I64`, ...).
    pub dtype: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// The values converted to f64 (exact for every float dtype and for
    /// integers up to 2^53).
    pub values: Vec<f64>,
    /// The sha256 of the stored bytes.
    pub sha256: String,
}

/// Reads every tensor of a safetensors image, converting numeric dtypes to
/// f64. `source` names the file in errors.
///
/// # Errors
/// A [`GoldenError`] naming the file (unreadable header) or the tensor (an
/// unsupported dtype).
pub fn load(source: &str, bytes: &[u8]) -> Result<Vec<(String, Loaded)>, GoldenError> {
    let st = views(source, bytes)?;
    let mut out = st
        .iter()
        .map(|(name, view)| Ok((name.to_string(), widen(source, name, &view)?)))
        .collect::<Result<Vec<_>, GoldenError>>()?;
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// The tensors of a safetensors image, unread: names, dtypes and shapes
/// from the header (so that they can be checked before any value is
/// widened). `source` names the file in errors.
///
/// # Errors
/// A [`GoldenError`] naming the file when the header is unreadable.
pub fn views<'a>(source: &str, bytes: &'a [u8]) -> Result<SafeTensors<'a>, GoldenError> {
    SafeTensors::deserialize(bytes)
        .map_err(|e| GoldenError::new(format!("{source}: not a safetensors file: {e}")))
}

/// The safetensors dtype name of `view` (`F32`, `I64`, ...).
pub fn dtype_name(view: &TensorView<'_>) -> String {
    format!("{:?}", view.dtype())
}

/// One tensor of a safetensors image widened to f64 ([`Loaded`]).
///
/// # Errors
/// A [`GoldenError`] naming the file and tensor when its dtype is not a
/// float or integer one.
pub fn widen(source: &str, name: &str, view: &TensorView<'_>) -> Result<Loaded, GoldenError> {
    let values = to_f64(view.dtype(), view.data()).ok_or_else(|| {
        GoldenError::new(format!(
            "{source}: tensor {name} has dtype {:?}; expected a float (F64, F32, F16, BF16) or integer dtype",
            view.dtype()
        ))
    })?;
    Ok(Loaded {
        dtype: dtype_name(view),
        shape: view.shape().to_vec(),
        values,
        sha256: sha256_hex(view.data()),
    })
}

fn to_f64(dtype: StDtype, data: &[u8]) -> Option<Vec<f64>> {
    fn chunks<const N: usize>(data: &[u8], f: impl Fn([u8; N]) -> f64) -> Vec<f64> {
        data.chunks_exact(N)
            .map(|c| f(c.try_into().expect("chunks of N bytes")))
            .collect()
    }
    Some(match dtype {
        StDtype::F64 => chunks::<8>(data, f64::from_le_bytes),
        StDtype::F32 => chunks::<4>(data, |b| f32::from_le_bytes(b) as f64),
        StDtype::F16 => chunks::<2>(data, |b| half::f16::from_le_bytes(b).to_f64()),
        StDtype::BF16 => chunks::<2>(data, |b| half::bf16::from_le_bytes(b).to_f64()),
        StDtype::I64 => chunks::<8>(data, |b| i64::from_le_bytes(b) as f64),
        StDtype::I32 => chunks::<4>(data, |b| i32::from_le_bytes(b) as f64),
        StDtype::I16 => chunks::<2>(data, |b| i16::from_le_bytes(b) as f64),
        StDtype::I8 => chunks::<1>(data, |b| i8::from_le_bytes(b) as f64),
        StDtype::U64 => chunks::<8>(data, |b| u64::from_le_bytes(b) as f64),
        StDtype::U32 => chunks::<4>(data, |b| u32::from_le_bytes(b) as f64),
        StDtype::U16 => chunks::<2>(data, |b| u16::from_le_bytes(b) as f64),
        StDtype::U8 | StDtype::BOOL => data.iter().map(|&b| f64::from(b)).collect(),
        _ => return None,
    })
}
