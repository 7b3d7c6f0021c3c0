//! The arithmetic of `embed`'s own pass for a few rows (`few.rs`): dense
//! products that read the weights where they lie, attention for one head,
//! and GELU, with AVX2 and FMA.
//!
//! A product of ~14 rows by a weight matrix is where a single text spends
//! its time. A general matrix product (candle's) first copies the whole
//! matrix; here four weight rows meet two activation rows at a time, eight
//! sums in registers, while the next weight rows are fetched into the
//! cache, so the weights stream from memory once per product without the
//! core waiting on them: each thread walks its own run of rows, and the
//! rows two items (of four rows) ahead go to L2 in the first pass over the
//! activations, those one item ahead to L1 in the second.

use candle_core::Device;

use crate::pool::Pool;

/// Whether this CPU runs the kernels (AVX2 and FMA on x86_64) and the
/// tensors are on it.
pub(super) fn available(device: &Device) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        device.is_cpu() && is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = device;
        false
    }
}

/// One dense product, `out[i][j] = bias[j] + x[i] · w[j]`: `w` is `n` rows
/// of `k` (a linear layer's weight, as stored), `x` is `rows` rows of `k`,
/// `out` is `rows` rows of `n`.
pub(super) struct Product<'a> {
    pub w: &'a [f32],
    pub bias: &'a [f32],
    pub x: &'a [f32],
    pub out: &'a mut [f32],
}

/// Runs `products` on `pool`, all in one dispatch (a layer's query, key
/// and value share one), four weight rows per item.
///
/// The caller has checked [`available`]; every `k` is a multiple of 8.
pub(super) fn products(pool: &Pool, products: &mut [Product<'_>]) {
    struct Job {
        w: usize,
        bias: usize,
        x: usize,
        out: usize,
        n: usize,
        k: usize,
        rows: usize,
        first: usize,
    }
    let mut jobs = Vec::with_capacity(products.len());
    let mut items = 0;
    for p in products.iter_mut() {
        let n = p.bias.len();
        let k = p.w.len() / n.max(1);
        let rows = p.x.len() / k.max(1);
        assert!(
            n > 0 && k % 8 == 0 && p.w.len() == n * k && p.x.len() == rows * k,
            "a {n}x{k} product of {} activations",
            p.x.len()
        );
        assert_eq!(p.out.len(), rows * n, "a product's output");
        jobs.push(Job {
            w: p.w.as_ptr() as usize,
            bias: p.bias.as_ptr() as usize,
            x: p.x.as_ptr() as usize,
            out: p.out.as_mut_ptr() as usize,
            n,
            k,
            rows,
            first: items,
        });
        items += n.div_ceil(4);
    }
    split(pool, items, |item| {
        let job = jobs
            .iter()
            .rev()
            .find(|j| j.first <= item)
            .expect("item 0 is the first job's");
        let j = (item - job.first) * 4;
        let take = (job.n - j).min(4);
        let w = job.w as *const f32;
        // The next two items' weight rows, fetched while these run.
        let row = |at: usize| {
            if at < job.n {
                // SAFETY: row `at` is inside `w` (`n` rows of `k`).
                unsafe { w.add(at * job.k) }
            } else {
                std::ptr::null()
            }
        };
        let ahead = [row(j + take), row(j + take + 4)];
        // SAFETY: `available` saw AVX2 and FMA (the caller's); rows
        // `j..j + take` of `w` and `bias` and all `rows` of `x` are the
        // borrowed slices' (asserted above); columns `j..j + take` of
        // every output row are written by this item alone.
        unsafe {
            quad(
                w.add(j * job.k),
                take,
                job.x as *const f32,
                job.rows,
                job.k,
                (job.bias as *const f32).add(j),
                (job.out as *mut f32).add(j),
                job.n,
                ahead,
            )
        };
    });
}

/// Runs `f` on every item of `0..items` on `pool`. Each
/// thread walks a contiguous share in order, so that the weights an item
/// fetches ahead are its own thread's next (a shared cursor handing out
/// small chunks left each chunk's first weights cold: 6–8% fewer products
/// a second); one done with its share takes what is left of another's,
/// from the far end, so a thread the machine holds back delays no one.
fn split(pool: &Pool, items: usize, f: impl Fn(usize) + Sync) {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    let threads = pool.threads();
    // (Shares are packed in 32 bits each: more items than that run here.)
    if threads <= 1 || items < 2 || items > u32::MAX as usize {
        (0..items).for_each(f);
        return;
    }
    // Each share's next and end, in one word: its thread takes the next,
    // the others the last.
    let pack = |next: usize, end: usize| ((next as u64) << 32) | end as u64;
    let unpack = |word: u64| ((word >> 32) as usize, (word & u64::from(u32::MAX)) as usize);
    // A cache line each: the other threads touch a share only to take
    // from it.
    #[repr(align(64))]
    struct Share(AtomicU64);
    let shares: Vec<Share> = (0..threads)
        .map(|t| {
            Share(AtomicU64::new(pack(
                t * items / threads,
                (t + 1) * items / threads,
            )))
        })
        .collect();
    let take = |Share(share): &Share, front: bool| -> Option<usize> {
        let mut word = share.load(Relaxed);
        loop {
            let (next, end) = unpack(word);
            if next >= end {
                return None;
            }
            let (taken, left) = match front {
                true => (next, pack(next + 1, end)),
                false => (end - 1, pack(next, end - 1)),
            };
            match share.compare_exchange_weak(word, left, Relaxed, Relaxed) {
                Ok(_) => return Some(taken),
                Err(now) => word = now,
            }
        }
    };
    pool.execute(|t| {
        let t = t.min(threads - 1);
        while let Some(item) = take(&shares[t], true) {
            f(item);
        }
        for other in 1..threads {
            while let Some(item) = take(&shares[(t + other) % threads], false) {
                f(item);
            }
        }
    });
}

/// Weight rows to bring into the cache while a block runs, a line a step:
/// into L1 (`near`: the next block's), or into L2 (`far`: the one after).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Fetch {
    rows: *const f32,
    far: bool,
}

#[cfg(target_arch = "x86_64")]
impl Fetch {
    const NONE: Fetch = Fetch {
        rows: std::ptr::null(),
        far: false,
    };

    fn near(rows: *const f32) -> Fetch {
        Fetch { rows, far: false }
    }

    fn far(rows: *const f32) -> Fetch {
        Fetch { rows, far: true }
    }

    /// Brings line `c` of each of `n` rows `k` apart (a hint: no access
    /// happens, any address is allowed).
    #[inline(always)]
    fn lines(self, n: usize, k: usize, c: usize) {
        use std::arch::x86_64::*;
        if self.rows.is_null() {
            return;
        }
        for r in 0..n {
            let at = self.rows.wrapping_add(r * k + c) as *const i8;
            // SAFETY: a prefetch reads nothing; SSE is x86_64's baseline.
            unsafe {
                if self.far {
                    _mm_prefetch::<_MM_HINT_T1>(at);
                } else {
                    _mm_prefetch::<_MM_HINT_T0>(at);
                }
            }
        }
    }
}

/// `take` (≤ 4) weight rows from `w` against every one of `rows` activation
/// rows of `x`, plus `bias`, into `out` (`stride` apart); `ahead` are the
/// next two items' weight rows (up to four each, null past the end), to
/// bring into the cache meanwhile.
///
/// # Safety
/// AVX2 and FMA; the rows named are readable (and `out`'s writable) for `k`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn quad(
    w: *const f32,
    take: usize,
    x: *const f32,
    rows: usize,
    k: usize,
    bias: *const f32,
    out: *mut f32,
    stride: usize,
    [next, after]: [*const f32; 2],
) {
    // The weights stream from memory: the item after next goes to L2 in
    // the first pass, the next to L1 in the second, so that neither waits.
    // With one pass, the next in it.
    let fetch = |i: usize| match (i, rows > 2) {
        (0, true) => Fetch::far(after),
        (0, false) | (2, _) => Fetch::near(next),
        _ => Fetch::NONE,
    };
    // SAFETY (all below): the caller's bounds.
    let put = |i: usize, r: usize, v: f32| unsafe { *out.add(i * stride + r) = v + *bias.add(r) };
    if take == 4 {
        let mut i = 0;
        while i + 2 <= rows {
            let sums = unsafe { block::<4, 2>(w, x.add(i * k), k, fetch(i)) };
            for (m, row) in sums.iter().enumerate() {
                for (r, v) in row.iter().enumerate() {
                    put(i + m, r, *v);
                }
            }
            i += 2;
        }
        if i < rows {
            let sums = unsafe { block::<4, 1>(w, x.add(i * k), k, fetch(i)) };
            for (r, v) in sums[0].iter().enumerate() {
                put(i, r, *v);
            }
        }
    } else {
        for i in 0..rows {
            for r in 0..take {
                let sums = unsafe { block::<1, 1>(w.add(r * k), x.add(i * k), k, Fetch::NONE) };
                put(i, r, sums[0][0]);
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
unsafe fn quad(
    _: *const f32,
    _: usize,
    _: *const f32,
    _: usize,
    _: usize,
    _: *const f32,
    _: *mut f32,
    _: usize,
    _: [*const f32; 2],
) {
    unreachable!("`available` is false off x86_64")
}

/// The dot products of `R` weight rows with `M` activation rows, all `k`
/// long and `k` apart; `R` of `fetch`'s rows are brought into the cache
/// meanwhile, a line every 16 floats.
///
/// # Safety
/// AVX2 and FMA; `R` rows from `w` and `M` from `x` are readable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn block<const R: usize, const M: usize>(
    w: *const f32,
    x: *const f32,
    k: usize,
    fetch: Fetch,
) -> [[f32; R]; M] {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); R]; M];
    for c in (0..k).step_by(8) {
        if c % 16 == 0 {
            fetch.lines(R, k, c);
        }
        let mut wv = [_mm256_setzero_ps(); R];
        for (r, v) in wv.iter_mut().enumerate() {
            // SAFETY: the caller's.
            *v = unsafe { _mm256_loadu_ps(w.add(r * k + c)) };
        }
        for (m, row) in acc.iter_mut().enumerate() {
            // SAFETY: the caller's.
            let xv = unsafe { _mm256_loadu_ps(x.add(m * k + c)) };
            for (a, wr) in row.iter_mut().zip(&wv) {
                *a = _mm256_fmadd_ps(*wr, xv, *a);
            }
        }
    }
    let mut sums = [[0f32; R]; M];
    for (row, acc) in sums.iter_mut().zip(&acc) {
        for (s, a) in row.iter_mut().zip(acc) {
            *s = sum8(*a);
        }
    }
    sums
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
fn sum8(a: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let half = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    let pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
    _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)))
}

/// `a · b`, eight lanes at a time (the compiler vectorises the lanes).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(p, q)| p * q)
        .sum();
    for (p, q) in ac.zip(bc) {
        for l in 0..8 {
            lanes[l] = p[l].mul_add(q[l], lanes[l]);
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// One text's attention for one head: for every query row `i`,
/// `softmax(q_i · k_j * scale + mask_j) · v_j` over the `len` key rows,
/// written to `out` row `i`. `q`, `k`, `v` and `out` are `len` rows,
/// `stride` apart, of which the head's `width` values are read or written
/// (`out` by pointer: other heads write the columns between);
/// `mask` is 0 where a token may be attended to, `f32::MIN` where not;
/// `scores` is scratch of `len`.
///
/// # Safety
/// AVX2 and FMA (for the vector lanes); `out`'s `len` rows of `width` are
/// writable and no one else's meanwhile.
#[allow(clippy::too_many_arguments)]
#[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx2,fma"))]
pub(super) unsafe fn attend(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: *mut f32,
    stride: usize,
    width: usize,
    mask: &[f32],
    scale: f32,
    scores: &mut [f32],
) {
    let len = mask.len();
    let row = |i: usize| i * stride..i * stride + width;
    for i in 0..len {
        let qi = &q[row(i)];
        let mut max = f32::NEG_INFINITY;
        for (j, s) in scores.iter_mut().enumerate().take(len) {
            *s = dot(qi, &k[row(j)]) * scale + mask[j];
            max = max.max(*s);
        }
        let mut total = 0f32;
        for s in scores.iter_mut().take(len) {
            *s = (*s - max).exp();
            total += *s;
        }
        // SAFETY: the caller's.
        let o = unsafe { std::slice::from_raw_parts_mut(out.add(i * stride), width) };
        o.fill(0.0);
        for (j, s) in scores.iter().enumerate().take(len) {
            let p = s / total;
            for (o, vj) in o.iter_mut().zip(&v[row(j)]) {
                *o = p.mul_add(*vj, *o);
            }
        }
    }
}

/// GELU in place: exact (`x Φ(x)`, with an `erf` good to 1e-7) or tanh's
/// approximation, as candle computes them.
///
/// # Safety
/// AVX2 and FMA (for the vector lanes).
#[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx2,fma"))]
pub(super) unsafe fn gelu(xs: &mut [f32], exact: bool) {
    if exact {
        for x in xs.iter_mut() {
            *x = (erf(*x * std::f32::consts::FRAC_1_SQRT_2) + 1.0) * 0.5 * *x;
        }
    } else {
        const SQRT_TWO_OVER_PI: f32 = 0.797_884_6;
        for x in xs.iter_mut() {
            let v = *x;
            *x = 0.5 * v * (1.0 + (SQRT_TWO_OVER_PI * v * (1.0 + 0.044715 * v * v)).tanh());
        }
    }
}

/// `erf(x)` as a rational function of `x` clamped to ±4 (past which it is
/// ±1 in f32): Eigen's and XLA's single-precision form, within 1e-7 of the
/// true value, and branch-free, so a loop of it runs eight lanes at a time.
#[inline(always)]
pub(super) fn erf(x: f32) -> f32 {
    let x = x.clamp(-4.0, 4.0);
    let x2 = x * x;
    let mut p = x2.mul_add(-2.726_142_3e-10, 2.770_681_4e-8);
    for c in [
        -2.101_024e-6,
        -5.692_506_4e-5,
        -7.349_906_3e-4,
        -2.954_600_1e-3,
        -1.609_603_3e-2,
    ] {
        p = x2.mul_add(p, c);
    }
    let mut q = x2.mul_add(-1.456_607_2e-5, -2.133_740_6e-4);
    for c in [-1.682_827e-3, -7.373_329e-3, -1.426_474e-2] {
        q = x2.mul_add(q, c);
    }
    x * p / q
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_agrees_with_candles() {
        let mut worst = 0f32;
        for i in -60_000..=60_000 {
            let x = i as f32 / 10_000.0;
            worst = worst.max((erf(x) - candle_core::cpu::erf::erf_f32(x)).abs());
        }
        assert!(worst < 1e-6, "erf differs from candle's by up to {worst}");
    }

    #[test]
    fn products_match_a_plain_sum() {
        if !available(&Device::Cpu) {
            return;
        }
        // Odd shapes: a last item of fewer than four rows, odd row counts,
        // one and two passes over the activations; two products at once.
        let shapes = [
            (10, 24, 5),
            (64, 16, 1),
            (36, 32, 2),
            (100, 8, 3),
            (40, 16, 14),
        ];
        let pool = Pool::new(2, "test-pool");
        for pair in shapes.windows(2) {
            let made: Vec<_> = pair
                .iter()
                .map(|&(n, k, rows)| {
                    let w: Vec<f32> = (0..n * k).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
                    let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.5).collect();
                    let x: Vec<f32> = (0..rows * k).map(|i| ((i * 3) % 7) as f32 - 3.0).collect();
                    (w, bias, x)
                })
                .collect();
            let mut outs: Vec<Vec<f32>> = pair
                .iter()
                .map(|&(n, _, rows)| vec![f32::NAN; rows * n])
                .collect();
            let mut products_of: Vec<Product<'_>> = made
                .iter()
                .zip(outs.iter_mut())
                .map(|((w, bias, x), out)| Product { w, bias, x, out })
                .collect();
            products(&pool, &mut products_of);
            drop(products_of);
            for ((w, bias, x), out) in made.iter().zip(&outs) {
                let (n, rows) = (bias.len(), out.len() / bias.len());
                let k = w.len() / n;
                for i in 0..rows {
                    for j in 0..n {
                        let want: f32 =
                            bias[j] + (0..k).map(|c| x[i * k + c] * w[j * k + c]).sum::<f32>();
                        assert_eq!(
                            out[i * n + j],
                            want,
                            "{n}x{k} by {rows}: row {i}, column {j}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn split_runs_every_item_once() {
        use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
        let pool = Pool::new(2, "test-pool");
        for items in [0, 1, 2, 3, 7, 96, 1000] {
            let seen: Vec<AtomicUsize> = (0..items).map(|_| AtomicUsize::new(0)).collect();
            split(&pool, items, |i| {
                seen[i].fetch_add(1, Relaxed);
            });
            assert!(seen.iter().all(|s| s.load(Relaxed) == 1), "{items} items");
        }
    }
}
