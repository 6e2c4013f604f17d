//! The common case of a tensor's JSON `data`, decoded without serde: (nested) arrays of plain
//! numbers, each read as its text is checked against JSON's grammar. Anything else (`null`,
//! strings, booleans, malformed text, a number out of the type's range) makes the fast path
//! answer `None`, and the serde path then decodes or refuses it with its own message, so both
//! accept exactly the same documents and this one only answers faster.
//!
//! A float is read in the same pass that checks its grammar: its digits gathered into an
//! integer `m` and its decimal exponent `e`, then `m × 10^e` in one `f64` operation (Clinger's
//! fast path: exact when `m ≤ 2^53` and `|e| ≤ 22`), which covers how clients write tensors
//! (`-0.25`, `1.2345678e-3`, and for `f32` also Python's `-0.30000001192092896`). Everything
//! else goes to fast-float2 with the text already delimited.

/// An element type the fast path reads: how one number's text, starting at `at` and already
/// known to begin with `-` or a digit, becomes a value, and where it ends.
pub(super) trait Scan: Sized {
    fn scan(bytes: &[u8], at: usize) -> Option<(Self, usize)>;
}

/// `json`'s values when it is (nested) arrays of plain JSON numbers that `T` reads; `None` on
/// anything else.
pub(super) fn numbers<T: Scan>(json: &str) -> Option<Vec<T>> {
    let bytes = json.as_bytes();
    // Clients write `, ` between numbers of a few digits: about 6 bytes each.
    let mut out = Vec::with_capacity(bytes.len() / 5);
    let (mut i, mut depth) = (0usize, 0usize);
    // After `[` or `,` a value must come; after a value or `]`, a `,` or a `]`.
    let mut want_value = true;
    let mut just_opened = false;
    while i < bytes.len() {
        match bytes[i] {
            b' ' | b'\n' | b'\r' | b'\t' => i += 1,
            b'[' if want_value => {
                depth += 1;
                just_opened = true;
                i += 1;
            }
            b']' if depth > 0 && (!want_value || just_opened) => {
                depth -= 1;
                want_value = false;
                just_opened = false;
                i += 1;
            }
            b',' if !want_value && depth > 0 => {
                want_value = true;
                just_opened = false;
                i += 1;
            }
            b'-' | b'0'..=b'9' if want_value && depth > 0 => {
                // This number, and the run of a flat array after it (`1.5, -2, 3`), without
                // going round the match for each separator.
                let mut at = i;
                loop {
                    let (value, end) = T::scan(bytes, at)?;
                    out.push(value);
                    i = end;
                    at = match bytes.get(i..i + 3) {
                        Some([b',', b' ', c]) if c.is_ascii_digit() || *c == b'-' => i + 2,
                        Some([b',', c, _]) if c.is_ascii_digit() || *c == b'-' => i + 1,
                        _ => break,
                    };
                }
                want_value = false;
                just_opened = false;
            }
            _ => return None,
        }
        if depth == 0 {
            // The outermost array closed: only whitespace may follow.
            return bytes[i..].iter().all(|b| b.is_ascii_whitespace()).then_some(out);
        }
    }
    None
}

/// An integer's text as `T`: plain digits only (`3.0` and `1e3` take the serde path, which
/// accepts a whole number written as a float).
pub(super) fn integer<T: TryFrom<i64>>(bytes: &[u8], at: usize) -> Option<(T, usize)> {
    let end = Decimal::read(bytes, at)?.end;
    let text = &bytes[at..end];
    if text.iter().any(|b| matches!(b, b'.' | b'e' | b'E')) {
        return None;
    }
    let text = std::str::from_utf8(text).ok()?;
    Some((T::try_from(text.parse::<i64>().ok()?).ok()?, end))
}

/// A float's text, as read in one pass: the value `±m × 10^exponent` when it fits the fast path,
/// and where the text ends.
struct Decimal {
    negative: bool,
    /// The significant digits as an integer, when there were at most 19 of them.
    mantissa: Option<u64>,
    exponent: i64,
    end: usize,
}

/// Appends the run of digits at `i` to `m`, eight bytes at a time: the digits among them found
/// and read together, without a branch per digit (a loop per digit mispredicts its end, and
/// `m × 10 + d` one digit at a time is a chain of dependent multiplies). Returns how many digits
/// there were.
#[inline(always)]
fn gather(b: &[u8], i: &mut usize, m: &mut u64) -> usize {
    const POW10_U64: [u64; 9] = [1, 10, 100, 1_000, 10_000, 100_000, 1_000_000, 10_000_000, 100_000_000];
    let start = *i;
    // The first two digits one at a time: most numbers have them, so these branches are
    // predicted, and a number of one or two digits is read without the multiplies below.
    for _ in 0..2 {
        match b.get(*i).map(|c| c.wrapping_sub(b'0')).filter(|d| *d < 10) {
            Some(d) => {
                *m = m.wrapping_mul(10).wrapping_add(u64::from(d));
                *i += 1;
            }
            None => return *i - start,
        }
    }
    while let Some(eight) = b.get(*i..*i + 8) {
        // Each digit becomes its value 0..=9 and any other byte gets a high nibble: its own (its
        // high nibble was not 3) or one from adding 6 (`:` to `?`). A carry from that addition
        // only reaches later bytes, past the first one flagged.
        let x = u64::from_le_bytes(eight.try_into().unwrap_or_default()) ^ 0x3030_3030_3030_3030;
        let flagged = (x | x.wrapping_add(0x0606_0606_0606_0606)) & 0xF0F0_F0F0_F0F0_F0F0;
        if flagged == 0 {
            *m = m.wrapping_mul(100_000_000).wrapping_add(eight_digits(x));
            *i += 8;
            continue;
        }
        // The `n` digits before the first other byte moved to the top bytes, zeros before
        // them: one eight-digit number.
        let n = (flagged.trailing_zeros() / 8) as usize;
        if n > 0 {
            *m = m
                .wrapping_mul(POW10_U64[n])
                .wrapping_add(eight_digits(x << (8 * (8 - n))));
            *i += n;
        }
        return *i - start;
    }
    while let Some(d) = b.get(*i).map(|c| c.wrapping_sub(b'0')).filter(|d| *d < 10) {
        *m = m.wrapping_mul(10).wrapping_add(u64::from(d));
        *i += 1;
    }
    *i - start
}

/// The number written by eight digit values (`0..=9` in each byte, the first byte the most
/// significant digit): pairs, then fours, then all eight, in three multiplies.
#[inline(always)]
fn eight_digits(x: u64) -> u64 {
    const MASK: u64 = 0x0000_00FF_0000_00FF;
    let v = x.wrapping_mul(10).wrapping_add(x >> 8);
    (v & MASK)
        .wrapping_mul(100 + (1_000_000 << 32))
        .wrapping_add(((v >> 16) & MASK).wrapping_mul(1 + (10_000 << 32)))
        >> 32
}

/// The exact powers of ten in `f64`.
const POW10: [f64; 23] = [
    1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20,
    1e21, 1e22,
];

impl Decimal {
    /// The JSON number at `at`, its grammar checked as its digits are gathered
    /// (`-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`, stricter than a float parser's).
    #[inline(always)]
    fn read(b: &[u8], at: usize) -> Option<Decimal> {
        let negative = b[at] == b'-';
        let mut i = at + usize::from(negative);
        // `m` holds every digit from the first that is not a leading zero; past 19 of them it
        // may have wrapped, and is not used.
        let (mut m, mut digits) = (0u64, 0usize);
        match b.get(i)? {
            b'0' => i += 1,
            b'1'..=b'9' => digits += gather(b, &mut i, &mut m),
            _ => return None,
        }
        let mut exponent = 0i64;
        if b.get(i) == Some(&b'.') {
            i += 1;
            let start = i;
            if m == 0 {
                while b.get(i) == Some(&b'0') {
                    i += 1;
                }
            }
            digits += gather(b, &mut i, &mut m);
            if i == start {
                return None;
            }
            exponent -= (i - start) as i64;
        }
        if matches!(b.get(i), Some(b'e' | b'E')) {
            i += 1;
            let sign = match b.get(i) {
                Some(b'-') => {
                    i += 1;
                    -1
                }
                Some(b'+') => {
                    i += 1;
                    1
                }
                _ => 1,
            };
            let start = i;
            let mut written = 0i64;
            while let Some(d) = b.get(i).map(|c| c.wrapping_sub(b'0')).filter(|d| *d < 10) {
                // Saturates far beyond any exponent a float can use.
                written = (written * 10 + i64::from(d)).min(1 << 40);
                i += 1;
            }
            if i == start {
                return None;
            }
            exponent += sign * written;
        }
        Some(Decimal {
            negative,
            mantissa: (digits <= 19).then_some(m),
            exponent,
            end: i,
        })
    }

    /// The value in `f64`, and whether it is correctly rounded: when `m` and `10^|e|` are both
    /// exact there, one division or multiplication rounds the exact value once. With more than
    /// 53 bits of `m` (17 to 19 digits, as Python writes an `f64`), `m` is rounded first, so the
    /// result is within 2 ulps (`2^-52` relative) of the exact value, and only an `f32` can use it.
    #[inline(always)]
    fn near_f64(&self) -> Option<(f64, bool)> {
        let m = self.mantissa?;
        let v = match self.exponent {
            e @ -22..=-1 => m as f64 / POW10[(-e) as usize],
            e @ 0..=22 => m as f64 * POW10[e as usize],
            _ => return None,
        };
        // The sign set without a branch: clients' signs are as random as their values.
        let v = f64::from_bits(v.to_bits() | u64::from(self.negative) << 63);
        Some((v, m <= 1 << 53))
    }
}

impl Scan for f64 {
    #[inline(always)]
    fn scan(bytes: &[u8], at: usize) -> Option<(f64, usize)> {
        let d = Decimal::read(bytes, at)?;
        let v = match d.near_f64() {
            Some((v, true)) => v,
            _ => fast_float2::parse::<f64, _>(&bytes[at..d.end])
                .ok()
                .filter(|v| v.is_finite())?,
        };
        Some((v, d.end))
    }
}

impl Scan for f32 {
    #[inline(always)]
    fn scan(bytes: &[u8], at: usize) -> Option<(f32, usize)> {
        let d = Decimal::read(bytes, at)?;
        // Every value here is zero or at least `10^-22`, a normal `f32` (or too large for one,
        // refused below), so going to `f32` drops the `f64`'s lowest 29 bits. That rounds
        // the exact value correctly unless the `f64` is at the midpoint between two `f32`s (the
        // dropped bits `1000…0`) where the exact value is not, or, when the `f64` is off by up to
        // 2 ulps, that close to it: those few are read again from the text.
        const DROPPED: u64 = (1 << 29) - 1;
        const HALF: u64 = 1 << 28;
        let v = match d.near_f64() {
            Some((v, exact)) if (v.to_bits() & DROPPED).abs_diff(HALF) > if exact { 0 } else { 4 } => v as f32,
            _ => fast_float2::parse::<f32, _>(&bytes[at..d.end]).ok()?,
        };
        v.is_finite().then_some((v, d.end))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn one<T: Scan>(text: &str) -> Option<T> {
        let (v, end) = T::scan(text.as_bytes(), 0)?;
        (end == text.len()).then_some(v)
    }

    proptest! {
        /// Any decimal a client might write, against fast-float2's reading of the same text.
        #[test]
        fn a_decimal_reads_as_fast_float2_reads_it(
            negative in any::<bool>(),
            int in prop_oneof![Just(0u64), 1u64..10, 1u64..1_000_000, any::<u64>()],
            fraction in prop_oneof![Just(String::new()), "[0-9]{1,30}"],
            exponent in prop_oneof![Just(String::new()), "[eE][+-]?[0-9]{1,3}"],
        ) {
            let text = format!(
                "{}{int}{}{fraction}{exponent}",
                if negative { "-" } else { "" },
                if fraction.is_empty() { "" } else { "." },
            );
            let want32 = fast_float2::parse::<f32, _>(&text).ok().filter(|v| v.is_finite());
            let want64 = fast_float2::parse::<f64, _>(&text).ok().filter(|v| v.is_finite());
            prop_assert_eq!(one::<f32>(&text).map(f32::to_bits), want32.map(f32::to_bits), "{}", text);
            prop_assert_eq!(one::<f64>(&text).map(f64::to_bits), want64.map(f64::to_bits), "{}", text);
        }

        /// Decimals next to the midpoint between two `f32`s: where rounding through `f64` could
        /// round twice.
        #[test]
        fn a_decimal_near_an_f32_midpoint_rounds_once(bits in 0x0080_0000u32..0x7f00_0000, nudge in -3i64..=3) {
            let (low, high) = (f64::from(f32::from_bits(bits)), f64::from(f32::from_bits(bits + 1)));
            let mid = (low + high) / 2.0;
            let near = f64::from_bits((mid.to_bits() as i64 + nudge) as u64);
            for text in [format!("{mid:e}"), format!("{near:e}"), format!("{near:?}"), format!("{:.17e}", near)] {
                let want = fast_float2::parse::<f32, _>(&text).ok().filter(|v| v.is_finite());
                prop_assert_eq!(one::<f32>(&text).map(f32::to_bits), want.map(f32::to_bits), "{}", text);
            }
        }
    }

    #[test]
    fn exact_midpoints_and_the_fast_paths_edges() {
        // 1 + 2^-24 is exactly halfway between 1 and the next f32: ties to even, 1.
        assert_eq!(one::<f32>("1.000000059604644775390625"), Some(1.0));
        // A hair above it in 17 digits rounds to the f64 halfway point; the text is above it.
        assert_eq!(
            one::<f32>("1.0000000596046448"),
            fast_float2::parse::<f32, _>("1.0000000596046448").ok()
        );
        assert_eq!(one::<f32>("-0").map(f32::to_bits), Some((-0.0f32).to_bits()));
        assert_eq!(one::<f64>("9007199254740993"), Some(9007199254740992.0));
        assert_eq!(one::<f64>("1e22"), Some(1e22));
        assert_eq!(one::<f64>("1e23"), Some(1e23));
        assert_eq!(one::<f64>("1e-400"), Some(0.0));
        assert_eq!(one::<f32>("1e39"), None, "too large for FP32");
        assert_eq!(
            one::<f32>("0.00000000000000000000000000000000000000000001"),
            Some(1e-44)
        );
        // `00` is `0` and then a digit the array's loop refuses.
        assert_eq!(f64::scan(b"00", 0), Some((0.0, 1)));
        assert_eq!(f32::scan(b"1.", 0), None);
        assert_eq!(f32::scan(b"1e+", 0), None);
    }
}
