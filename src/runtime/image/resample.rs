//! Pillow's resize of an 8-bit image (`Image.resize(size, resample)`, its `Resample.c`), to the
//! same bytes: the processors of `transformers` (CLIP's, SigLIP's) resize through Pillow, and a
//! model's vectors were made from those bytes. The `image` crate's filters are the same curves
//! but round differently (in f32, once; Pillow rounds to 8 bits after its horizontal pass, with
//! 22-bit fixed-point weights), which moves a pixel by one level here and there.

use std::f64::consts::PI;

/// A resampling filter by Pillow's number (`PIL.Image.Resampling`, what a
/// `preprocessor_config.json`'s `resample` holds). Nearest (0) is not one: Pillow does not
/// convolve for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    /// 1: Lanczos, 3 lobes.
    Lanczos,
    /// 2: linear.
    Bilinear,
    /// 3: cubic, a = -0.5 (CLIP's).
    Bicubic,
    /// 4: box.
    Box,
    /// 5: Hamming-windowed sinc.
    Hamming,
}

impl Filter {
    /// The filter of Pillow's number `n`, or `None` for nearest (0) and unknown numbers.
    pub fn from_pillow(n: u64) -> Option<Filter> {
        Some(match n {
            1 => Filter::Lanczos,
            2 => Filter::Bilinear,
            3 => Filter::Bicubic,
            4 => Filter::Box,
            5 => Filter::Hamming,
            _ => return None,
        })
    }

    /// How far from its centre the filter reaches, in source pixels at scale 1.
    fn support(self) -> f64 {
        match self {
            Filter::Box => 0.5,
            Filter::Bilinear | Filter::Hamming => 1.0,
            Filter::Bicubic => 2.0,
            Filter::Lanczos => 3.0,
        }
    }

    /// The filter's weight at `x`.
    fn weight(self, x: f64) -> f64 {
        let sinc = |x: f64| if x == 0.0 { 1.0 } else { (x * PI).sin() / (x * PI) };
        match self {
            Filter::Box => f64::from(u8::from(x > -0.5 && x <= 0.5)),
            Filter::Bilinear => (1.0 - x.abs()).max(0.0),
            Filter::Hamming => {
                let x = x.abs();
                match x {
                    0.0 => 1.0,
                    x if x >= 1.0 => 0.0,
                    x => {
                        let x = x * PI;
                        x.sin() / x * (0.54 + 0.46 * x.cos())
                    }
                }
            }
            Filter::Bicubic => {
                let (a, x) = (-0.5, x.abs());
                if x < 1.0 {
                    ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * a
                } else {
                    0.0
                }
            }
            Filter::Lanczos => match x.abs() < 3.0 {
                true => sinc(x) * sinc(x / 3.0),
                false => 0.0,
            },
        }
    }
}

/// Pillow's fixed point: 32 bits, less 8 for the pixel and 2 for the sum's headroom.
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// For each output pixel of an axis `input` long resized to `output`: the first source pixel it
/// reads, and its fixed-point weights (Pillow's `precompute_coeffs` and
/// `normalize_coeffs_8bpc`).
fn coefficients(input: usize, output: usize, filter: Filter) -> Vec<(usize, Vec<i32>)> {
    let scale = input as f64 / output as f64;
    let filterscale = scale.max(1.0);
    let support = filter.support() * filterscale;
    (0..output)
        .map(|out| {
            let center = (out as f64 + 0.5) * scale;
            // Pillow truncates toward zero after adding 0.5 (a C cast), then clamps.
            let first = ((center - support + 0.5) as i64).max(0) as usize;
            let last = ((center + support + 0.5) as i64).min(input as i64) as usize;
            let weights: Vec<f64> = (first..last)
                .map(|x| filter.weight((x as f64 - center + 0.5) / filterscale))
                .collect();
            let total: f64 = weights.iter().sum();
            let fixed = weights
                .iter()
                .map(|w| {
                    let w = if total != 0.0 { w / total } else { *w };
                    let scaled = w * f64::from(1u32 << PRECISION_BITS);
                    (if w < 0.0 { scaled - 0.5 } else { scaled + 0.5 }) as i32
                })
                .collect();
            (first, fixed)
        })
        .collect()
}

/// One output level from a fixed-point sum: rounded, shifted back and clamped to 0..=255.
fn level(sum: i64) -> u8 {
    ((sum + (1 << (PRECISION_BITS - 1))) >> PRECISION_BITS).clamp(0, 255) as u8
}

/// An 8-bit RGB image, its rows one after the other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rgb {
    /// Pixels across.
    pub width: usize,
    /// Pixels down.
    pub height: usize,
    /// `width * height * 3` levels, red, green, blue.
    pub data: Vec<u8>,
}

/// `image` resized to `width` x `height` with `filter`, as Pillow resizes it: a horizontal pass
/// over the rows the vertical pass will read, rounded to 8 bits, then the vertical pass. An axis
/// whose size does not change is not resampled.
pub fn resize(image: &Rgb, width: usize, height: usize, filter: Filter) -> Rgb {
    let horizontal = (width != image.width).then(|| coefficients(image.width, width, filter));
    let vertical = (height != image.height).then(|| coefficients(image.height, height, filter));
    // The source rows the vertical pass reads, all of them without one.
    let (top, bottom) = match &vertical {
        Some(rows) => {
            let (first, last) = (&rows[0], &rows[rows.len() - 1]);
            (first.0, last.0 + last.1.len())
        }
        None => (0, image.height),
    };
    let wide = match &horizontal {
        Some(columns) => {
            let mut data = Vec::with_capacity((bottom - top) * width * 3);
            for y in top..bottom {
                let row = &image.data[y * image.width * 3..][..image.width * 3];
                for (first, weights) in columns {
                    for c in 0..3 {
                        let sum: i64 = weights
                            .iter()
                            .enumerate()
                            .map(|(k, w)| i64::from(row[(first + k) * 3 + c]) * i64::from(*w))
                            .sum();
                        data.push(level(sum));
                    }
                }
            }
            Rgb {
                width,
                height: bottom - top,
                data,
            }
        }
        None => Rgb {
            width: image.width,
            height: bottom - top,
            data: image.data[top * image.width * 3..bottom * image.width * 3].to_vec(),
        },
    };
    let Some(rows) = vertical else {
        return wide;
    };
    let stride = width * 3;
    let mut data = Vec::with_capacity(height * stride);
    for (first, weights) in &rows {
        for x in 0..stride {
            let sum: i64 = weights
                .iter()
                .enumerate()
                .map(|(k, w)| i64::from(wide.data[(first - top + k) * stride + x]) * i64::from(*w))
                .sum();
            data.push(level(sum));
        }
    }
    Rgb { width, height, data }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_sum_to_one_in_fixed_point_and_reach_as_far_as_the_filter_scaled() {
        for filter in [
            Filter::Lanczos,
            Filter::Bilinear,
            Filter::Bicubic,
            Filter::Box,
            Filter::Hamming,
        ] {
            for (input, output) in [(97, 32), (20, 32), (48, 32)] {
                for (first, weights) in coefficients(input, output, filter) {
                    let sum: i64 = weights.iter().map(|&w| i64::from(w)).sum();
                    assert!(
                        (sum - (1 << PRECISION_BITS)).abs() <= weights.len() as i64,
                        "{filter:?} {sum}"
                    );
                    assert!(first + weights.len() <= input);
                }
            }
        }
        // Downscaling 3x with bicubic reads 2 * 2 * 3 source pixels around each centre (12).
        let wide = coefficients(96, 32, Filter::Bicubic);
        assert_eq!(wide[16].1.len(), 12);
    }

    #[test]
    fn a_flat_image_stays_flat_and_an_unchanged_size_is_a_copy() {
        let flat = Rgb {
            width: 7,
            height: 5,
            data: [10, 200, 33].repeat(35),
        };
        let resized = resize(&flat, 3, 9, Filter::Bicubic);
        assert_eq!(resized.data, [10, 200, 33].repeat(27));
        assert_eq!(resize(&flat, 7, 5, Filter::Lanczos), flat);
    }
}
