//! Fitting peak working memory to an input's dimensions.
//!
//! The candidate terms over `k` axes with product `P = Π dims` are a constant (the workspace),
//! each axis alone (two inputs that grow separately), `P` (a convolution's activations grow with
//! height × width × batch), `P·dᵢ` for every axis but a batch (attention scores: `batch·seq²`)
//! and `P²/batch`. The fit is a
//! weighted least-squares one on relative error, over every subset of those terms whose
//! coefficients are all non-negative (so a larger input never costs less), and it keeps the
//! smallest subset that fits about as well as the best one: fewer terms extrapolate more safely
//! to inputs far larger than the measured ones.

use super::{Dims, Term, monomial};

/// A fitted profile: the constant and the growing terms (raised so that no point it was fitted
/// to took more than it says), with the fit's relative RMS error.
#[derive(Debug, Clone, PartialEq)]
pub struct Fitted {
    /// The constant term, in bytes.
    pub workspace: f64,
    /// The growing terms.
    pub terms: Vec<Term>,
    /// Root-mean-square relative error over the points.
    pub error: f64,
}

/// Peaks below this count as this much when weighing relative error, so that runs of a few
/// bytes do not decide the fit.
const FLOOR_BYTES: f64 = 16.0 * 1024.0;

/// Exhaustive search up to this many candidate columns (2^11 subsets); greedy beyond.
const EXHAUSTIVE_COLUMNS: usize = 11;

/// The candidate monomials over axes of which `batch` says which are a batch, deduplicated
/// (one axis: `d`, `d²`), constant first. No batch axis is ever squared: the items of a batch
/// are independent, so memory grows linearly with their number (`P²` becomes `P²/batch`).
pub fn candidates(batch: &[bool]) -> Vec<Vec<u8>> {
    let k = batch.len();
    let mut out: Vec<Vec<u8>> = vec![vec![0; k]];
    let mut push = |p: Vec<u8>| {
        if !out.contains(&p) {
            out.push(p);
        }
    };
    for i in 0..k {
        let mut p = vec![0; k];
        p[i] = 1;
        push(p);
    }
    if k > 0 {
        push(vec![1; k]);
        for i in (0..k).filter(|&i| !batch[i]) {
            let mut p = vec![1; k];
            p[i] = 2;
            push(p);
        }
        if batch.iter().any(|b| !b) {
            push(batch.iter().map(|&b| if b { 1 } else { 2 }).collect());
        }
    }
    out
}

/// Fit `points` (dimensions over the axes `batch` describes, peak bytes). With no points the
/// fit is zero.
pub fn fit(batch: &[bool], points: &[(Dims, u64)]) -> Fitted {
    let columns = candidates(batch);
    let rows: Vec<(Vec<f64>, f64)> = points
        .iter()
        .map(|(dims, y)| (columns.iter().map(|p| monomial(dims, p)).collect(), *y as f64))
        .collect();
    let n = rows.len();
    if n == 0 {
        return Fitted {
            workspace: 0.0,
            terms: Vec::new(),
            error: 0.0,
        };
    }
    // No more terms than points less one (an exactly determined fit explains anything), except
    // that a single point is a constant.
    let max_terms = if n == 1 { 1 } else { n - 1 };
    let mut tried: Vec<(Vec<usize>, Vec<f64>, f64)> = Vec::new();
    if columns.len() <= EXHAUSTIVE_COLUMNS {
        for mask in 1u32..(1 << columns.len()) {
            let subset: Vec<usize> = (0..columns.len()).filter(|c| mask & (1 << c) != 0).collect();
            if subset.len() > max_terms {
                continue;
            }
            if let Some((coefficients, error)) = solve(&rows, &subset) {
                tried.push((subset, coefficients, error));
            }
        }
    } else {
        tried = greedy(&rows, columns.len(), max_terms);
    }
    let Some(best) = tried.iter().map(|t| t.2).min_by(f64::total_cmp) else {
        let max = rows.iter().map(|r| r.1).fold(0.0, f64::max);
        return Fitted {
            workspace: max,
            terms: Vec::new(),
            error: 0.0,
        };
    };
    // The arena hands out blocks in rounded sizes, so a few percent is noise, not shape.
    let good_enough = best * 1.1 + 0.05;
    // Only growing terms count against a subset: a constant cannot extrapolate badly.
    // Then the lowest degree: between `batch` and `batch²` that fit alike, the line is the
    // safer guess for a batch a hundred times larger.
    let growing = |subset: &[usize]| subset.iter().filter(|&&c| c != 0).count();
    let degree = |subset: &[usize]| {
        let total = |c: &usize| columns[*c].iter().map(|&p| u32::from(p)).sum::<u32>();
        subset.iter().map(total).max().unwrap_or(0)
    };
    let (subset, coefficients, error) = tried
        .into_iter()
        .filter(|t| t.2 <= good_enough)
        .min_by(|a, b| {
            (growing(&a.0), degree(&a.0))
                .cmp(&(growing(&b.0), degree(&b.0)))
                .then(a.2.total_cmp(&b.2))
        })
        .expect("the best subset is good enough");
    // The largest input measured did not take more than the fit says: scaled up to it (at most
    // by half), an estimate errs on the side of redirecting, not of failing on the device, for
    // the large requests admission must judge right. (Smaller runs miss by the arena's rounding
    // and by how a runtime plans small tensors, which large ones do not share.)
    let predicted = |x: &[f64]| subset.iter().zip(&coefficients).map(|(&c, k)| x[c] * k).sum::<f64>();
    let size = |dims: &Dims| dims.product();
    let margin = points
        .iter()
        .zip(&rows)
        .max_by(|a, b| size(&a.0.0).total_cmp(&size(&b.0.0)))
        .map(|(_, (x, y))| y / predicted(x))
        .filter(|r| r.is_finite())
        .unwrap_or(1.0)
        .clamp(1.0, 1.5);
    let mut fitted = Fitted {
        workspace: 0.0,
        terms: Vec::new(),
        error,
    };
    let coefficients: Vec<f64> = coefficients.iter().map(|c| c * margin).collect();
    for (&c, &bytes) in subset.iter().zip(&coefficients) {
        if c == 0 {
            fitted.workspace = bytes;
        } else if bytes > 0.0 {
            fitted.terms.push(Term {
                bytes,
                powers: columns[c].clone(),
            });
        }
    }
    fitted
}

/// Forward selection for many axes: add the column that lowers the error most, while it does.
fn greedy(rows: &[(Vec<f64>, f64)], columns: usize, max_terms: usize) -> Vec<(Vec<usize>, Vec<f64>, f64)> {
    let mut chosen: Vec<usize> = Vec::new();
    let mut tried = Vec::new();
    let mut current = f64::INFINITY;
    while chosen.len() < max_terms {
        let step = (0..columns)
            .filter(|c| !chosen.contains(c))
            .filter_map(|c| {
                let mut subset = chosen.clone();
                subset.push(c);
                subset.sort_unstable();
                solve(rows, &subset).map(|(coefficients, error)| (subset, coefficients, error))
            })
            .min_by(|a, b| a.2.total_cmp(&b.2));
        let Some(step) = step else { break };
        if step.2 > current * 0.99 {
            break;
        }
        current = step.2;
        chosen = step.0.clone();
        tried.push(step);
    }
    tried
}

/// Weighted least squares on relative error over the columns in `subset`: the coefficients and
/// the RMS relative error, or `None` when the system is singular or a coefficient is negative.
fn solve(rows: &[(Vec<f64>, f64)], subset: &[usize]) -> Option<(Vec<f64>, f64)> {
    let m = subset.len();
    // Each row divided by its own peak makes the residuals relative; each column then scaled
    // to a largest magnitude of 1 keeps the normal equations well conditioned when one term is
    // `P²` and another a constant.
    let weight = |y: f64| 1.0 / y.max(FLOOR_BYTES);
    let scale: Vec<f64> = subset
        .iter()
        .map(|&c| rows.iter().map(|(x, y)| (x[c] * weight(*y)).abs()).fold(0.0, f64::max))
        .collect();
    if scale.iter().any(|&s| s == 0.0 || !s.is_finite()) {
        return None;
    }
    let mut normal = vec![vec![0.0; m + 1]; m];
    for (x, y) in rows {
        let w = weight(*y);
        let xs: Vec<f64> = subset.iter().zip(&scale).map(|(&c, s)| x[c] * w / s).collect();
        for r in 0..m {
            for c in 0..m {
                normal[r][c] += xs[r] * xs[c];
            }
            normal[r][m] += xs[r] * y * w;
        }
    }
    let scaled = gauss(normal)?;
    let coefficients: Vec<f64> = scaled.iter().zip(&scale).map(|(c, s)| c / s).collect();
    // A coefficient a hair below zero is rounding in an exact fit; one clearly below is a term
    // the data do not support. (A scaled coefficient is the term's share of a peak.)
    if scaled.iter().any(|&c| c < -1e-9) {
        return None;
    }
    let coefficients: Vec<f64> = coefficients.into_iter().map(|c| c.max(0.0)).collect();
    let squares: f64 = rows
        .iter()
        .map(|(x, y)| {
            let predicted: f64 = subset.iter().zip(&coefficients).map(|(&c, k)| x[c] * k).sum();
            ((predicted - y) * weight(*y)).powi(2)
        })
        .sum();
    Some((coefficients, (squares / rows.len() as f64).sqrt()))
}

/// Gaussian elimination with partial pivoting on an augmented `m × (m+1)` matrix.
fn gauss(mut a: Vec<Vec<f64>>) -> Option<Vec<f64>> {
    let m = a.len();
    for col in 0..m {
        let pivot = (col..m).max_by(|&x, &y| a[x][col].abs().total_cmp(&a[y][col].abs()))?;
        if a[pivot][col].abs() < 1e-12 {
            return None;
        }
        a.swap(col, pivot);
        let pivot_row = a[col].clone();
        for (r, row) in a.iter_mut().enumerate() {
            if r != col {
                let factor = row[col] / pivot_row[col];
                for (value, p) in row.iter_mut().zip(&pivot_row).skip(col) {
                    *value -= factor * p;
                }
            }
        }
    }
    let solution: Vec<f64> = (0..m).map(|r| a[r][m] / a[r][r]).collect();
    solution.iter().all(|v| v.is_finite()).then_some(solution)
}
