//! Q4_1 weight matrices times f32 activations on the CPU, with AVX2.
//!
//! candle has SIMD dot products for Q4_0, Q8_0 and the K-quants, but its
//! Q4_1 one is the generic scalar loop, and SmolLM2's shipped file is Q4_1:
//! decoding it ran at a third of llama.cpp's speed on the same file. This is
//! ggml's `vec_dot_q4_1_q8_1` for AVX2, over the same blocks: each row of
//! activations is quantized to Q8_1 exactly as candle quantizes it (the
//! scale and the sum rounded to f16), so the integer sums are candle's and
//! only the order of the float additions differs. The work is split over
//! candle's own compute pool, so `threads` governs it as it does the rest.
//!
//! [`Linear`] picks this path for a Q4_1 matrix on a CPU with AVX2, FMA and
//! F16C, and candle's `QMatMul` for anything else (other types, a GPU, an
//! older CPU), so the weights are used as the file has them either way.

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Result, Tensor};
use half::f16;

/// Elements per block, in Q4_1 and Q8_1 alike.
const QK: usize = 32;
/// Bytes of one Q4_1 block: the scale `d` and the minimum `m` (f16 each),
/// then 16 bytes of nibbles (element `j` low, element `j + 16` high).
const Q4_1_BYTES: usize = 20;

/// A weight matrix for `x @ Wᵀ`: this file's kernel or candle's.
pub(super) enum Linear {
    Candle(QMatMul),
    Q4_1(Q4_1Matrix),
}

impl Linear {
    pub(super) fn new(t: QTensor) -> Result<Linear> {
        if t.dtype() == GgmlDType::Q4_1 && runs_on(&t.device()) {
            return Ok(Linear::Q4_1(Q4_1Matrix::new(&t)?));
        }
        QMatMul::from_qtensor(t).map(Linear::Candle)
    }

    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Linear::Candle(m) => m.forward(x),
            Linear::Q4_1(m) => m.forward(x),
        }
    }
}

/// Whether Q4_1 matrices on `device` run on this file's kernel.
pub(super) fn runs_on(device: &Device) -> bool {
    device.is_cpu() && simd_available()
}

/// Whether this CPU runs the kernel (checked once by the standard library).
fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `rows` × `cols` weights, row-major Q4_1 blocks as the file stores them.
pub(super) struct Q4_1Matrix {
    rows: usize,
    cols: usize,
    blocks: Vec<u8>,
}

/// One block of a row of activations, quantized as candle quantizes for
/// Q4_1 (`BlockQ8_1::from_float`); `d` and `s` hold f16 values as f32.
#[derive(Clone, Copy)]
#[repr(C)]
struct Q8_1 {
    d: f32,
    s: f32,
    qs: [i8; QK],
}

impl Q4_1Matrix {
    fn new(t: &QTensor) -> Result<Q4_1Matrix> {
        let (rows, cols) = t.shape().dims2()?;
        if cols % QK != 0 {
            candle_core::bail!("a Q4_1 matrix of {cols} columns, not a multiple of {QK}");
        }
        let blocks = t.data()?.into_owned();
        if blocks.len() != rows * (cols / QK) * Q4_1_BYTES {
            candle_core::bail!(
                "a Q4_1 matrix of {rows}x{cols} holds {} bytes, not {}",
                blocks.len(),
                rows * (cols / QK) * Q4_1_BYTES
            );
        }
        Ok(Q4_1Matrix { rows, cols, blocks })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims();
        if dims.last() != Some(&self.cols) {
            candle_core::bail!(
                "{:?} activations for a matrix of {} columns",
                dims,
                self.cols
            );
        }
        let xs: Vec<f32> = x.flatten_all()?.to_vec1()?;
        let m = xs.len() / self.cols;
        let per_row = self.cols / QK;
        // SAFETY: `Linear::new` chose this path only where the CPU has AVX2.
        let lhs: Vec<Q8_1> = xs
            .chunks_exact(QK)
            .map(|b| unsafe { quantize(b) })
            .collect();
        let mut out = vec![0f32; m * self.rows];
        let (n, out_at) = (self.rows, out.as_mut_ptr() as usize);
        let row_bytes = per_row * Q4_1_BYTES;
        // SAFETY (both writes): every (i, r) is written by exactly one work
        // item, and `i * n + r < m * n`, the buffer's length.
        let put = |i: usize, r: usize, v: f32| unsafe { *(out_at as *mut f32).add(i * n + r) = v };
        // Work items are quads of weight rows: their blocks stay in L1 while
        // every row of activations passes them, and one activation block
        // loaded serves four dot products.
        candle_core::utils::barrier_pool().execute_chunked(n.div_ceil(4), |quads| {
            for quad in quads {
                let r = quad * 4;
                if r + 4 <= n {
                    let w = &self.blocks[r * row_bytes..(r + 4) * row_bytes];
                    for (i, x) in lhs.chunks_exact(per_row).enumerate() {
                        // SAFETY: `Linear::new` chose this path only where
                        // the CPU has AVX2, FMA and F16C; `w` is four rows
                        // of `per_row` blocks, `x` one.
                        let dots = unsafe { dot4(w, row_bytes, x) };
                        for (j, v) in dots.into_iter().enumerate() {
                            put(i, r + j, v);
                        }
                    }
                } else {
                    for r in r..n {
                        let w = &self.blocks[r * row_bytes..(r + 1) * row_bytes];
                        for (i, x) in lhs.chunks_exact(per_row).enumerate() {
                            // SAFETY: as above, for one row.
                            put(i, r, unsafe { dot(w, x) });
                        }
                    }
                }
            }
        });
        let mut shape = dims.to_vec();
        *shape.last_mut().expect("checked above") = self.rows;
        Tensor::from_vec(out, shape, &Device::Cpu)
    }
}

/// `BlockQ8_1::from_float` for one block: the same rounding, so the same
/// integers and the same f16 scale and sum. (With SSE4.1, which AVX2
/// implies, the compiler rounds inline rather than calling `roundf`.)
#[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx2"))]
unsafe fn quantize(xs: &[f32]) -> Q8_1 {
    let amax = xs.iter().fold(0f32, |a, x| a.max(x.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut qs = [0i8; QK];
    let mut sum = 0i32;
    for (q, x) in qs.iter_mut().zip(xs) {
        *q = (x * id).round() as i8;
        sum += i32::from(*q);
    }
    let d = f16::from_f32(d);
    Q8_1 {
        d: d.to_f32(),
        s: (f16::from_f32(sum as f32) * d).to_f32(),
        qs,
    }
}

/// Σ over blocks of `Σ q_w·q_x · d_w · d_x + m_w · s_x`: ggml's
/// `vec_dot_q4_1_q8_1`. Each block's integer sum is taken with AVX2; the
/// float arithmetic is candle's scalar loop's, operation for operation and
/// in its order, so the result is candle's to the bit.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot(w: &[u8], x: &[Q8_1]) -> f32 {
    use std::arch::x86_64::*;
    let mut sum = 0f32;
    for (b, y) in w.chunks_exact(Q4_1_BYTES).zip(x) {
        // `d` and `m`, two f16 side by side, widened at once.
        let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from_le_bytes([
            b[0], b[1], b[2], b[3],
        ])));
        let (d, m) = (_mm_cvtss_f32(dm), _mm_cvtss_f32(_mm_movehdup_ps(dm)));
        // SAFETY: `b` is a whole block; `y.qs` is 32 bytes.
        let s8 = unsafe {
            block_sums(
                b.as_ptr(),
                _mm256_loadu_si256(y.qs.as_ptr() as *const __m256i),
            )
        };
        // The eight partial sums, then all.
        let s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
        let s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
        let s1 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1));
        let sumi = _mm_cvtsi128_si32(s1);
        sum += sumi as f32 * d * y.d + m * y.s;
    }
    sum
}

/// [`dot`] for four weight rows (`row_bytes` apart) against one row of
/// activations: each activation block is loaded once, the four integer sums
/// are reduced together, and the four rows' float sums run in the lanes of
/// one vector with [`dot`]'s operations in its order (multiplies and adds,
/// never fused), so each lane is [`dot`]'s result to the bit.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot4(w: &[u8], row_bytes: usize, x: &[Q8_1]) -> [f32; 4] {
    use std::arch::x86_64::*;
    // [d0, m0, d1, m1, d2, m2, d3, m3] → [d0..d3 | m0..m3].
    let split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    let mut sum = _mm_setzero_ps();
    assert!(w.len() >= 4 * row_bytes && x.len() * Q4_1_BYTES <= row_bytes);
    for (b, y) in x.iter().enumerate() {
        // SAFETY (the pointers and loads below): block `b` of row `j` lies at
        // `j * row_bytes + b * 20`, inside `w` by the assertion above; a
        // block is 20 bytes and `y.qs` 32.
        let block = |j: usize| unsafe { w.as_ptr().add(j * row_bytes + b * Q4_1_BYTES) };
        let (b0, b1, b2, b3) = (block(0), block(1), block(2), block(3));
        let (s0, s1, s2, s3, scales) = unsafe {
            let qy = _mm256_loadu_si256(y.qs.as_ptr() as *const __m256i);
            (
                block_sums(b0, qy),
                block_sums(b1, qy),
                block_sums(b2, qy),
                block_sums(b3, qy),
                _mm_setr_epi32(
                    (b0 as *const i32).read_unaligned(),
                    (b1 as *const i32).read_unaligned(),
                    (b2 as *const i32).read_unaligned(),
                    (b3 as *const i32).read_unaligned(),
                ),
            )
        };
        // Four rows' eight partial sums each, reduced to one sum a row:
        // [r0, r1, r2, r3] (integers, exact in f32 below 2^24).
        let h = _mm256_hadd_epi32(_mm256_hadd_epi32(s0, s1), _mm256_hadd_epi32(s2, s3));
        let sumi = _mm_cvtepi32_ps(_mm_add_epi32(
            _mm256_castsi256_si128(h),
            _mm256_extracti128_si256(h, 1),
        ));
        let dm = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(scales), split);
        let (d, m) = (_mm256_castps256_ps128(dm), _mm256_extractf128_ps(dm, 1));
        let products = _mm_mul_ps(_mm_mul_ps(sumi, d), _mm_set1_ps(y.d));
        sum = _mm_add_ps(sum, _mm_add_ps(products, _mm_mul_ps(m, _mm_set1_ps(y.s))));
    }
    let mut out = [0f32; 4];
    // SAFETY: `out` holds four f32.
    unsafe { _mm_storeu_ps(out.as_mut_ptr(), sum) };
    out
}

/// One Q4_1 block's products with 32 activation bytes `qy`, as eight
/// partial i32 sums.
///
/// # Safety
/// `block` points at a whole block (20 bytes); the CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn block_sums(
    block: *const u8,
    qy: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // SAFETY: the caller's: 16 bytes of nibbles after 4 of scales.
    let nibbles = unsafe { _mm_loadu_si128(block.add(4) as *const __m128i) };
    // Elements 0..16 from the low nibbles, 16..32 from the high.
    let qw = _mm256_and_si256(
        _mm256_set_m128i(_mm_srli_epi16(nibbles, 4), nibbles),
        _mm256_set1_epi8(0x0F),
    );
    // Unsigned 0..15 times signed bytes, pairs summed into i16 (at most
    // 2·15·128, no saturation), then pairs of those into i32.
    _mm256_madd_epi16(_mm256_maddubs_epi16(qw, qy), _mm256_set1_epi16(1))
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn dot4(_: &[u8], _: usize, _: &[Q8_1]) -> [f32; 4] {
    unreachable!("Linear::new takes this path only on x86_64")
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn dot(_: &[u8], _: &[Q8_1]) -> f32 {
    unreachable!("Linear::new takes this path only on x86_64")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel against candle's own Q4_1 matmul on the same blocks, for
    /// one row and several: the same bits.
    #[test]
    fn agrees_with_candle() {
        if !simd_available() {
            return;
        }
        let (n, k) = (42, 96);
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
            .collect();
        let w = Tensor::from_vec(w, (n, k), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q4_1).unwrap();
        let ours = Q4_1Matrix::new(&q).unwrap();
        let theirs = QMatMul::from_qtensor(q).unwrap();
        for m in [1, 3] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 104_729 % 997) as f32 / 400.0) - 1.2)
                .collect();
            let x = Tensor::from_vec(x, (m, k), &Device::Cpu).unwrap();
            let a: Vec<Vec<f32>> = ours.forward(&x).unwrap().to_vec2().unwrap();
            let b: Vec<Vec<f32>> = theirs.forward(&x).unwrap().to_vec2().unwrap();
            for (ra, rb) in a.iter().zip(&b) {
                for (va, vb) in ra.iter().zip(rb) {
                    assert_eq!(va.to_bits(), vb.to_bits(), "{va} vs {vb}");
                }
            }
        }
    }
}
