//! `embed`'s own pass for a few rows of activations (one text, or a few
//! short ones): the encoder's arithmetic on plain slices, with no tensor
//! per operation.
//!
//! At batch 1 a text is ~14 rows, and candle's ~40 operations a layer each
//! cost more in allocation, dispatch and pool wake-ups than their
//! arithmetic: half of a single text's time went there once the products
//! were berth's own. This pass runs the same computation as `Bert`'s
//! candle path, in candle's order of operations (embeddings summed word +
//! type, then position; layer norms as candle's fused kernel computes them;
//! softmax after subtracting the row's maximum), with five dispatches a
//! layer to a compute pool of its own (`crate::pool`): query, key and
//! value together, attention's heads, attention's output, and each of the
//! feed-forward block's two products; the GELU's `erf`
//! is a rational approximation within 1e-7 of candle's.

use candle_core::{Result, StorageRef, Tensor};
use candle_transformers::models::bert::HiddenAct;

use super::kernel::{self, Product};
use crate::pool::Pool;

/// The encoder as this pass reads it: the weight matrices and embedding
/// tables as the loaded tensors (clones share their storage: no copy), the
/// biases and the layer norms' scales copied once at load (~20 KB a layer).
pub(super) struct Small {
    shape: Shape,
    word: Tensor,
    position: Tensor,
    token_type: Tensor,
    norm: Norm,
    layers: Vec<SmallLayer>,
    /// The pass's threads: the caller and its helpers.
    pool: Pool,
}

/// The encoder's sizes and activation.
pub(super) struct Shape {
    pub hidden: usize,
    pub heads: usize,
    pub eps: f32,
    pub act: HiddenAct,
}

/// One dense layer's tensors, as loaded: `weight` is `[out, in]`.
pub(super) struct DenseIn<'a> {
    pub weight: &'a Tensor,
    pub bias: &'a Tensor,
}

/// One encoder layer's tensors, as loaded.
pub(super) struct LayerIn<'a> {
    pub query: DenseIn<'a>,
    pub key: DenseIn<'a>,
    pub value: DenseIn<'a>,
    pub attention_out: DenseIn<'a>,
    pub attention_norm: &'a candle_nn::LayerNorm,
    pub intermediate: DenseIn<'a>,
    pub out: DenseIn<'a>,
    pub out_norm: &'a candle_nn::LayerNorm,
}

/// A dense layer: the weights where they lie, the bias copied.
struct Dense {
    weight: Tensor,
    bias: Vec<f32>,
}

impl Dense {
    fn new(d: &DenseIn) -> Result<Dense> {
        Ok(Dense {
            weight: d.weight.clone(),
            bias: values(d.bias)?,
        })
    }
}

struct SmallLayer {
    query: Dense,
    key: Dense,
    value: Dense,
    attention_out: Dense,
    attention_norm: Norm,
    intermediate: Dense,
    out: Dense,
    out_norm: Norm,
}

struct Norm {
    weight: Vec<f32>,
    bias: Vec<f32>,
}

fn values(t: &Tensor) -> Result<Vec<f32>> {
    t.flatten_all()?.to_vec1()
}

fn norm(n: &candle_nn::LayerNorm) -> Result<Norm> {
    let Some(bias) = n.bias() else {
        candle_core::bail!("a layer norm without a bias");
    };
    Ok(Norm {
        weight: values(n.weight())?,
        bias: values(bias)?,
    })
}

impl Small {
    /// `tables`: the word, position and token-type embeddings; `norm`: the
    /// embeddings' layer norm; `threads`: the pass's, the caller's included.
    pub(super) fn new<'a>(
        shape: Shape,
        threads: usize,
        tables: [&Tensor; 3],
        norm_in: &candle_nn::LayerNorm,
        layers: impl Iterator<Item = LayerIn<'a>>,
    ) -> Result<Small> {
        let layers = layers
            .map(|l| {
                Ok(SmallLayer {
                    query: Dense::new(&l.query)?,
                    key: Dense::new(&l.key)?,
                    value: Dense::new(&l.value)?,
                    attention_out: Dense::new(&l.attention_out)?,
                    attention_norm: norm(l.attention_norm)?,
                    intermediate: Dense::new(&l.intermediate)?,
                    out: Dense::new(&l.out)?,
                    out_norm: norm(l.out_norm)?,
                })
            })
            .collect::<Result<_>>()?;
        let [word, position, token_type] = tables.map(Tensor::clone);
        Ok(Small {
            shape,
            word,
            position,
            token_type,
            norm: norm(norm_in)?,
            layers,
            pool: Pool::new(threads, "berth-embed"),
        })
    }
}

/// A contiguous f32 CPU tensor's values, read where they lie while held.
struct Held<'a> {
    storage: StorageRef<'a>,
    start: usize,
    end: usize,
}

impl<'a> Held<'a> {
    fn of(t: &'a Tensor) -> Result<Held<'a>> {
        let (storage, layout) = t.storage_and_layout();
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("the weights are not contiguous");
        };
        Ok(Held {
            storage,
            start,
            end,
        })
    }

    fn values(&self) -> Result<&[f32]> {
        let candle_core::Storage::Cpu(cpu) = &*self.storage else {
            candle_core::bail!("the weights are not in CPU memory");
        };
        Ok(&cpu.as_slice::<f32>()?[self.start..self.end])
    }
}

/// The last hidden states, `n * len` rows of `hidden`, for `n` texts of
/// `len` tokens (`ids`, `types` and `mask` row-major, `mask` 1 for a token
/// and 0 for padding). The caller has checked [`kernel::available`].
pub(super) fn forward(
    small: &Small,
    ids: &[u32],
    types: &[u32],
    mask: &[u32],
    len: usize,
) -> Result<Vec<f32>> {
    let h = small.shape.hidden;
    let rows = ids.len();
    let (word, position, token_type) = (
        Held::of(&small.word)?,
        Held::of(&small.position)?,
        Held::of(&small.token_type)?,
    );
    let (word, position, token_type) = (word.values()?, position.values()?, token_type.values()?);
    let mut x = vec![0f32; rows * h];
    for (r, row) in x.chunks_exact_mut(h).enumerate() {
        let at = |table: &[f32], i: usize, what: &str| -> Result<std::ops::Range<usize>> {
            if (i + 1) * h > table.len() {
                candle_core::bail!("{what} {i} is past the model's {}", table.len() / h);
            }
            Ok(i * h..(i + 1) * h)
        };
        let w = &word[at(word, ids[r] as usize, "token id")?];
        let t = &token_type[at(token_type, types[r] as usize, "token type")?];
        let p = &position[at(position, r % len.max(1), "position")?];
        for (c, out) in row.iter_mut().enumerate() {
            *out = (w[c] + t[c]) + p[c];
        }
    }
    layer_norm(&mut x, &small.norm, small.shape.eps);
    // 0 where a token may be attended to, f32::MIN where not (candle's).
    let mask: Vec<f32> = mask
        .iter()
        .map(|m| if *m == 0 { f32::MIN } else { 0.0 })
        .collect();
    let inter = small
        .layers
        .first()
        .map(|l| l.intermediate.bias.len())
        .unwrap_or(0);
    SCRATCH.with(|scratch| {
        let mut s = scratch.take();
        for (buffer, size) in [
            (&mut s.q, rows * h),
            (&mut s.k, rows * h),
            (&mut s.v, rows * h),
            (&mut s.context, rows * h),
            (&mut s.mid, rows * inter),
            (&mut s.next, rows * h),
        ] {
            buffer.resize(size, 0.0);
        }
        let out = small
            .layers
            .iter()
            .try_fold(x, |x, layer| run_layer(small, layer, x, &mask, len, &mut s));
        scratch.set(s);
        out
    })
}

thread_local! {
    /// The pass's buffers, kept by each thread that runs it between texts:
    /// made afresh for each, their ~200 KB cost ~50 page faults a text, as
    /// the allocator gave the memory back to the kernel in between (2% of
    /// a text's time). At most [`super::bert::FEW_ROWS`] rows: 0.4 MB.
    static SCRATCH: std::cell::Cell<Scratch> = std::cell::Cell::new(Scratch::default());
}

/// The pass's buffers, reused across layers.
#[derive(Default)]
struct Scratch {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    context: Vec<f32>,
    mid: Vec<f32>,
    next: Vec<f32>,
}

fn held(d: &Dense) -> Result<Held<'_>> {
    Held::of(&d.weight)
}

/// `out = x · dᵀ + bias`, one dispatch.
fn product(pool: &Pool, d: &Dense, x: &[f32], out: &mut [f32]) -> Result<()> {
    let w = held(d)?;
    kernel::products(
        pool,
        &mut [Product {
            w: w.values()?,
            bias: &d.bias,
            x,
            out,
        }],
    );
    Ok(())
}

fn run_layer(
    small: &Small,
    l: &SmallLayer,
    x: Vec<f32>,
    mask: &[f32],
    len: usize,
    s: &mut Scratch,
) -> Result<Vec<f32>> {
    let (shape, pool) = (&small.shape, &small.pool);
    let (wq, wk, wv) = (held(&l.query)?, held(&l.key)?, held(&l.value)?);
    kernel::products(
        pool,
        &mut [
            Product {
                w: wq.values()?,
                bias: &l.query.bias,
                x: &x,
                out: &mut s.q,
            },
            Product {
                w: wk.values()?,
                bias: &l.key.bias,
                x: &x,
                out: &mut s.k,
            },
            Product {
                w: wv.values()?,
                bias: &l.value.bias,
                x: &x,
                out: &mut s.v,
            },
        ],
    );
    attention(pool, shape, s, mask, len);
    product(pool, &l.attention_out, &s.context, &mut s.next)?;
    add_and_norm(&mut s.next, &x, &l.attention_norm, shape.eps);
    let x = std::mem::replace(&mut s.next, x);
    product(pool, &l.intermediate, &x, &mut s.mid)?;
    match shape.act {
        // SAFETY: the caller checked `kernel::available`.
        HiddenAct::Gelu => unsafe { kernel::gelu(&mut s.mid, true) },
        HiddenAct::GeluApproximate => unsafe { kernel::gelu(&mut s.mid, false) },
        HiddenAct::Relu => s.mid.iter_mut().for_each(|v| *v = v.max(0.0)),
    }
    product(pool, &l.out, &s.mid, &mut s.next)?;
    add_and_norm(&mut s.next, &x, &l.out_norm, shape.eps);
    Ok(std::mem::replace(&mut s.next, x))
}

/// Every text's every head, on `pool`: `s.context` from `s.q`, `s.k` and
/// `s.v`.
fn attention(pool: &Pool, shape: &Shape, s: &mut Scratch, mask: &[f32], len: usize) {
    let h = shape.hidden;
    let width = h / shape.heads;
    let texts = mask.len() / len.max(1);
    let scale = 1.0 / (width as f32).sqrt();
    let (q, k, v) = (&s.q, &s.k, &s.v);
    let out = s.context.as_mut_ptr() as usize;
    let (heads, total) = (shape.heads, s.context.len());
    pool.chunked(texts * heads, |items| {
        let mut scores = vec![0f32; len];
        for item in items {
            let (t, head) = (item / heads, item % heads);
            let start = t * len * h + head * width;
            let end = start + (len - 1) * h + width;
            assert!(end <= total, "text {t} head {head} past the activations");
            // SAFETY: `available` (the caller's); this (text, head) alone
            // writes its `width` columns of its text's `len` rows, all
            // inside `context` (asserted).
            unsafe {
                kernel::attend(
                    &q[start..end],
                    &k[start..end],
                    &v[start..end],
                    (out as *mut f32).add(start),
                    h,
                    width,
                    &mask[t * len..(t + 1) * len],
                    scale,
                    &mut scores,
                )
            };
        }
    });
}

/// `y = layer_norm(y + x)`.
fn add_and_norm(y: &mut [f32], x: &[f32], norm: &Norm, eps: f32) {
    for (a, b) in y.iter_mut().zip(x) {
        *a += b;
    }
    layer_norm(y, norm, eps);
}

/// Each row normalised as candle's fused layer norm does: the mean and the
/// mean square summed in f32, the variance as their difference.
fn layer_norm(x: &mut [f32], norm: &Norm, eps: f32) {
    let h = norm.weight.len();
    for row in x.chunks_exact_mut(h) {
        let (mut sum, mut sum2) = (0f32, 0f32);
        for v in row.iter() {
            sum += v;
            sum2 += v * v;
        }
        let mean = sum / h as f32;
        let var = sum2 / h as f32 - mean * mean;
        let inv_std = (var + eps).sqrt().recip();
        for ((v, w), b) in row.iter_mut().zip(&norm.weight).zip(&norm.bias) {
            *v = (*v - mean) * inv_std * w + b;
        }
    }
}
