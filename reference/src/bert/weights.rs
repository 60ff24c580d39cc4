//! BERT parameters: the tensors, their Hugging Face names, loading from
//! `model.safetensors`, and seeded initialisation.
//!
//! Weights follow `torch.nn.Linear` (`[out, in]`); names are those of
//! Hugging Face's `BertForPreTraining` without the `bert.` prefix (which the
//! loader also accepts). The MLM decoder weight is tied to
//! `embeddings.word_embeddings.weight` and has no tensor of its own.

use ndarray::{Array1, Array2, ArrayViewD, ArrayViewMutD};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::{Dtype, SafeTensors};

use super::config::BertConfig;
use crate::error::{Error, Result};

layer_params! {
    /// The parameters of one encoder layer, in f64 (the reference) or another
    /// element type `A` (an f32 kernel's copy). `hidden` = `hidden_size`,
    /// `inter` = `intermediate_size`.
    #[derive(Debug, Clone, PartialEq)]
    pub struct LayerParams {
        /// `attention.self.query.weight: [hidden, hidden]`.
        query_w: Array2 "attention.self.query.weight",
        /// `attention.self.query.bias: [hidden]`.
        query_b: Array1 "attention.self.query.bias",
        /// `attention.self.key.weight: [hidden, hidden]`.
        key_w: Array2 "attention.self.key.weight",
        /// `attention.self.key.bias: [hidden]`.
        key_b: Array1 "attention.self.key.bias",
        /// `attention.self.value.weight: [hidden, hidden]`.
        value_w: Array2 "attention.self.value.weight",
        /// `attention.self.value.bias: [hidden]`.
        value_b: Array1 "attention.self.value.bias",
        /// `attention.output.dense.weight: [hidden, hidden]`.
        attn_out_w: Array2 "attention.output.dense.weight",
        /// `attention.output.dense.bias: [hidden]`.
        attn_out_b: Array1 "attention.output.dense.bias",
        /// `attention.output.LayerNorm.weight: [hidden]`.
        attn_ln_g: Array1 "attention.output.LayerNorm.weight",
        /// `attention.output.LayerNorm.bias: [hidden]`.
        attn_ln_b: Array1 "attention.output.LayerNorm.bias",
        /// `intermediate.dense.weight: [inter, hidden]`.
        inter_w: Array2 "intermediate.dense.weight",
        /// `intermediate.dense.bias: [inter]`.
        inter_b: Array1 "intermediate.dense.bias",
        /// `output.dense.weight: [hidden, inter]`.
        out_w: Array2 "output.dense.weight",
        /// `output.dense.bias: [hidden]`.
        out_b: Array1 "output.dense.bias",
        /// `output.LayerNorm.weight: [hidden]`.
        out_ln_g: Array1 "output.LayerNorm.weight",
        /// `output.LayerNorm.bias: [hidden]`.
        out_ln_b: Array1 "output.LayerNorm.bias",
    }
}

model_params! {
    /// All parameters of BERT with its pre-training heads (also used, with the
    /// same shapes, to hold their gradients).
    #[derive(Debug, Clone, PartialEq)]
    pub struct BertParams {
        head {
            /// `embeddings.word_embeddings.weight: [v, hidden]` (also the MLM decoder weight).
            word_embeddings: Array2 "embeddings.word_embeddings.weight",
            /// `embeddings.position_embeddings.weight: [max_position_embeddings, hidden]`.
            position_embeddings: Array2 "embeddings.position_embeddings.weight",
            /// `embeddings.token_type_embeddings.weight: [type_vocab_size, hidden]`.
            token_type_embeddings: Array2 "embeddings.token_type_embeddings.weight",
            /// `embeddings.LayerNorm.weight: [hidden]`.
            emb_ln_g: Array1 "embeddings.LayerNorm.weight",
            /// `embeddings.LayerNorm.bias: [hidden]`.
            emb_ln_b: Array1 "embeddings.LayerNorm.bias",
        }
        /// `encoder.layer.{i}.*`.
        layers: Vec<LayerParams> "encoder.layer.",
        tail {
            /// `pooler.dense.weight: [hidden, hidden]`.
            pooler_w: Array2 "pooler.dense.weight",
            /// `pooler.dense.bias: [hidden]`.
            pooler_b: Array1 "pooler.dense.bias",
            /// `cls.predictions.transform.dense.weight: [hidden, hidden]`.
            mlm_dense_w: Array2 "cls.predictions.transform.dense.weight",
            /// `cls.predictions.transform.dense.bias: [hidden]`.
            mlm_dense_b: Array1 "cls.predictions.transform.dense.bias",
            /// `cls.predictions.transform.LayerNorm.weight: [hidden]`.
            mlm_ln_g: Array1 "cls.predictions.transform.LayerNorm.weight",
            /// `cls.predictions.transform.LayerNorm.bias: [hidden]`.
            mlm_ln_b: Array1 "cls.predictions.transform.LayerNorm.bias",
            /// `cls.predictions.bias: [v]`, the decoder bias.
            mlm_bias: Array1 "cls.predictions.bias",
            /// `cls.seq_relationship.weight: [2, hidden]`.
            nsp_w: Array2 "cls.seq_relationship.weight",
            /// `cls.seq_relationship.bias: [2]`.
            nsp_b: Array1 "cls.seq_relationship.bias",
        }
    }
}

/// How [`BertParams::init`] fills a tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fill {
    /// Uniform in `[-a, a]`.
    Uniform(f64),
    /// `c + Uniform[-a, a]`.
    Around(f64, f64),
}

impl<A> LayerParams<A> {
    /// `hidden`: the query weight's rows.
    pub fn hidden(&self) -> usize {
        self.query_w.nrows()
    }

    /// `inter`: the intermediate weight's rows.
    pub fn intermediate(&self) -> usize {
        self.inter_w.nrows()
    }

    /// Checks that the shapes fit one layer of width [`Self::hidden`] and
    /// intermediate size [`Self::intermediate`].
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] naming the first tensor (by its Hugging Face
    /// name) that does not fit.
    pub fn check_shapes(&self) -> Result<()> {
        let (hd, it) = (self.hidden(), self.intermediate());
        let fits = |name: &str, shape: &[usize], want: &[usize]| {
            if shape == want {
                return Ok(());
            }
            Err(Error::ShapeMismatch {
                field: name.into(),
                expected: format!("{want:?}"),
                actual: shape.to_vec(),
            })
        };
        let checked = self.try_map(
            |name, a| {
                let want = matrix_shape(name, hd, it);
                fits(name, a.shape(), &want).map(|()| Array2::<()>::default((0, 0)))
            },
            |name, a| {
                let want = [vector_len(name, hd, it)];
                fits(name, a.shape(), &want).map(|()| Array1::<()>::default(0))
            },
        );
        checked.map(|_| ())
    }
}

impl LayerParams {
    fn zeros(c: &BertConfig) -> Self {
        let (hd, it) = (c.hidden_size, c.intermediate_size);
        LayerParams::from_fn(
            |name| Array2::zeros(matrix_shape(name, hd, it)),
            |name| Array1::zeros(vector_len(name, hd, it)),
        )
    }
}

/// The shape of the layer matrix named `name` (within the layer) at width
/// `hd` and intermediate size `it`.
fn matrix_shape(name: &str, hd: usize, it: usize) -> [usize; 2] {
    match name {
        "intermediate.dense.weight" => [it, hd],
        "output.dense.weight" => [hd, it],
        _ => [hd, hd],
    }
}

/// The length of the layer vector named `name`, as [`matrix_shape`].
fn vector_len(name: &str, hd: usize, it: usize) -> usize {
    if name == "intermediate.dense.bias" {
        it
    } else {
        hd
    }
}

/// Whether a tensor name belongs to a head that `BertModel` checkpoints lack
/// (MLM transform and bias, NSP).
pub fn is_pretraining_head(name: &str) -> bool {
    name.starts_with("cls.")
}

impl BertParams {
    /// All-zero parameters of `config`'s shapes (also a zero gradient).
    ///
    /// The caller bounds the sizes with [`BertConfig::validate`].
    pub fn zeros(config: &BertConfig) -> Self {
        let h = config.hidden_size;
        BertParams {
            word_embeddings: Array2::zeros((config.vocab_size, h)),
            position_embeddings: Array2::zeros((config.max_position_embeddings, h)),
            token_type_embeddings: Array2::zeros((config.type_vocab_size, h)),
            emb_ln_g: Array1::zeros(h),
            emb_ln_b: Array1::zeros(h),
            layers: (0..config.num_hidden_layers)
                .map(|_| LayerParams::zeros(config))
                .collect(),
            pooler_w: Array2::zeros((h, h)),
            pooler_b: Array1::zeros(h),
            mlm_dense_w: Array2::zeros((h, h)),
            mlm_dense_b: Array1::zeros(h),
            mlm_ln_g: Array1::zeros(h),
            mlm_ln_b: Array1::zeros(h),
            mlm_bias: Array1::zeros(config.vocab_size),
            nsp_w: Array2::zeros((2, h)),
            nsp_b: Array1::zeros(2),
        }
    }

    /// Every tensor with its Hugging Face name, in a fixed order.
    pub fn named(&self) -> Vec<(String, ArrayViewD<'_, f64>)> {
        self.named_all()
    }

    /// Every tensor, mutable, in the order of [`BertParams::named`].
    pub fn named_mut(&mut self) -> Vec<(String, ArrayViewMutD<'_, f64>)> {
        self.named_all_mut()
    }

    /// Random parameters for tests, deterministic in `seed` (ChaCha8): matrices
    /// uniform with variance `1 / fan_in` (embeddings: uniform in [-1, 1]),
    /// biases in [-0.1, 0.1], LayerNorm gains in [0.8, 1.2]. Every tensor is
    /// non-zero, so every gradient path is exercised.
    pub fn random(config: &BertConfig, seed: u64) -> Self {
        let mut p = BertParams::zeros(config);
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        for (name, mut t) in p.named_mut() {
            let fill = if name.contains("embeddings.") && name.ends_with(".weight") && t.ndim() == 2
            {
                Fill::Uniform(1.0)
            } else if name.contains("LayerNorm.weight") {
                Fill::Around(1.0, 0.2)
            } else if t.ndim() == 2 {
                Fill::Uniform((3.0 / t.shape()[1] as f64).sqrt())
            } else {
                Fill::Uniform(0.1)
            };
            fill_tensor(&mut t, fill, &mut rng);
        }
        p
    }

    /// Loads a `model.safetensors` image (`bytes`) for `config`.
    ///
    /// Tensors are read by name (with or without the `bert.` prefix), must
    /// have the shapes of `config`, and may be F32 or F64 (converted to f64).
    /// The pre-training heads that `BertModel` checkpoints lack (`cls.*`: MLM
    /// transform, decoder bias, NSP) are initialised as Hugging Face's
    /// `_init_weights` does, from a ChaCha8 RNG seeded with `seed`: weights
    /// uniform with standard deviation `initializer_range` (uniform rather than
    /// normal so the reference needs no distribution crate), biases 0,
    /// LayerNorm gains 1. The decoder weight is tied to the word embeddings,
    /// so MLM logits use the real embedding matrix. Returns the parameters and
    /// the names that were initialised.
    ///
    /// # Errors
    /// [`Error::Parse`] for an unreadable file; [`Error::InvalidArgument`]
    /// naming the tensor for a missing encoder tensor or an unsupported dtype;
    /// [`Error::ShapeMismatch`] naming the tensor for a wrong shape.
    pub fn from_safetensors(
        config: &BertConfig,
        bytes: &[u8],
        seed: u64,
    ) -> Result<(Self, Vec<String>)> {
        config.validate()?;
        let st = SafeTensors::deserialize(bytes).map_err(|e| Error::Parse {
            source_name: "model.safetensors".into(),
            line: 0,
            message: e.to_string(),
        })?;
        check_config_against_file(config, &st)?;
        let mut p = BertParams::zeros(config);
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut initialised = Vec::new();
        for (name, mut t) in p.named_mut() {
            let view = st
                .tensor(&name)
                .or_else(|_| st.tensor(&format!("bert.{name}")));
            let view = match view {
                Ok(v) => v,
                Err(_) if is_pretraining_head(&name) => {
                    let fill = if name.ends_with("LayerNorm.weight") {
                        Fill::Around(1.0, 0.0)
                    } else if t.ndim() == 2 {
                        Fill::Uniform(config.initializer_range * 3f64.sqrt())
                    } else {
                        Fill::Around(0.0, 0.0)
                    };
                    fill_tensor(&mut t, fill, &mut rng);
                    initialised.push(name);
                    continue;
                }
                Err(_) => {
                    return Err(Error::invalid(
                        name,
                        "tensor missing from model.safetensors",
                    ))
                }
            };
            if view.shape() != t.shape() {
                return Err(Error::ShapeMismatch {
                    field: name,
                    expected: format!("{:?} (from config.json)", t.shape()),
                    actual: view.shape().to_vec(),
                });
            }
            let data = view.data();
            match view.dtype() {
                Dtype::F32 => read_le(&mut t, data, |b| f64::from(f32::from_le_bytes(b))),
                Dtype::F64 => read_le(&mut t, data, f64::from_le_bytes),
                other => {
                    return Err(Error::invalid(
                        name,
                        format!("dtype {other:?} is not supported (F32 or F64)"),
                    ))
                }
            }
            if let Some(index) = t.iter().position(|v| !v.is_finite()) {
                return Err(Error::NonFiniteInput {
                    field: name,
                    index,
                    value: t.iter().nth(index).copied().unwrap_or(f64::NAN),
                });
            }
        }
        Ok((p, initialised))
    }

    /// Total number of scalars.
    pub fn num_values(&self) -> usize {
        self.named().iter().map(|(_, t)| t.len()).sum()
    }
}

/// Fills `t` with the little-endian `N`-byte values of `data`, each read by `read`.
fn read_le<const N: usize>(t: &mut ArrayViewMutD<f64>, data: &[u8], read: impl Fn([u8; N]) -> f64) {
    for (dst, chunk) in t.iter_mut().zip(data.chunks_exact(N)) {
        let mut b = [0u8; N];
        b.copy_from_slice(chunk);
        *dst = read(b);
    }
}

fn fill_tensor(t: &mut ArrayViewMutD<f64>, fill: Fill, rng: &mut ChaCha8Rng) {
    for v in t.iter_mut() {
        *v = match fill {
            Fill::Uniform(a) => a * (2.0 * rng.random::<f64>() - 1.0),
            Fill::Around(c, a) => c + a * (2.0 * rng.random::<f64>() - 1.0),
        };
    }
}

/// Checks `config.json` against the checkpoint's own shapes, and the
/// parameters against the memory budget, before any parameter is allocated:
/// a config whose vocabulary (or width, or depth) is not the weights' is
/// refused naming the config field, not after allocating its parameters.
fn check_config_against_file(config: &BertConfig, st: &SafeTensors<'_>) -> Result<()> {
    let h = config.hidden_size;
    let expect = [
        (
            "embeddings.word_embeddings.weight",
            "vocab_size",
            [config.vocab_size, h],
        ),
        (
            "embeddings.position_embeddings.weight",
            "max_position_embeddings",
            [config.max_position_embeddings, h],
        ),
        (
            "embeddings.token_type_embeddings.weight",
            "type_vocab_size",
            [config.type_vocab_size, h],
        ),
        (
            "encoder.layer.0.intermediate.dense.weight",
            "intermediate_size",
            [config.intermediate_size, h],
        ),
    ];
    for (name, field, shape) in expect {
        let view = st
            .tensor(name)
            .or_else(|_| st.tensor(&format!("bert.{name}")));
        let Ok(view) = view else {
            continue; // reported as missing with the other tensors
        };
        if view.shape() != shape {
            // The same error as a wrong shape found while loading, naming
            // the config field that disagrees with the file as well.
            let field = if view.shape().get(1) == Some(&shape[1]) {
                field
            } else {
                "hidden_size"
            };
            return Err(Error::ShapeMismatch {
                field: name.to_string(),
                expected: format!("{shape:?} (from config.json's {field})"),
                actual: view.shape().to_vec(),
            });
        }
    }
    // The layers the file has: one past the largest `encoder.layer.<i>.`.
    let file_layers = st
        .names()
        .into_iter()
        .filter_map(|name| {
            let rest = name.strip_prefix("bert.").unwrap_or(name);
            let rest = rest.strip_prefix("encoder.layer.")?;
            rest.split('.').next()?.parse::<usize>().ok()
        })
        .max()
        .map_or(0, |i| i.saturating_add(1));
    if file_layers != config.num_hidden_layers {
        return Err(Error::invalid(
            "num_hidden_layers",
            format!(
                "config.json gives {} layers, model.safetensors has {file_layers}",
                config.num_hidden_layers
            ),
        ));
    }
    // The parameters, their gradients and a second copy for the packed and
    // padded runs.
    let bytes = (config.num_parameters() as u64).checked_mul(8 * 4);
    crate::limits::check_estimate("config.json", bytes, "the model's parameters and gradients")
}
