//! Human-friendly sizes (`512MiB`, `2GiB`) and durations (`250ms`, `5s`) for the config file.
//!
//! Both deserialize from either a YAML number (bytes / milliseconds) or a string with a unit, so
//! operators can write what reads best and the error names what was expected.
//!
//! Hand-written on purpose: `bytesize` 2.7 and `humantime` 2.4 were evaluated and each would turn
//! input refused today into a value the operator may not have meant. `bytesize` reads `2g`,
//! `512M` and `512mb` as decimal (Docker reads `2g` as 2GiB), saturates `20000000TiB` to
//! `u64::MAX` instead of refusing it, and rejects `" 8 KiB "`. `humantime` reads `1M` as a month
//! (beside `1m`, a minute) and refuses the bare milliseconds (`"100"`) that config values and
//! policy `_ms` params accept. Guarding both would take as much code as these two parsers, and
//! neither crate's errors (`expected number at 0`) say more than ours.

use std::fmt;
use std::time::Duration;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

/// A number of bytes; parses `1024`, `"512KiB"`, `"2GiB"`, `"1.5GB"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// The size in bytes.
    pub fn bytes(self) -> u64 {
        self.0
    }
}

const SIZE_UNITS: &[(&str, u64)] = &[
    ("TiB", 1 << 40),
    ("GiB", 1 << 30),
    ("MiB", 1 << 20),
    ("KiB", 1 << 10),
    ("TB", 1_000_000_000_000),
    ("GB", 1_000_000_000),
    ("MB", 1_000_000),
    ("KB", 1_000),
    ("kB", 1_000),
    ("B", 1),
];

/// Parse a size such as `512MiB`; a bare number is bytes.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let (number, multiplier) = SIZE_UNITS
        .iter()
        .find_map(|(unit, mult)| text.strip_suffix(unit).map(|n| (n.trim(), *mult)))
        .unwrap_or((text, 1));
    let value: f64 = number
        .parse()
        .map_err(|_| format!("expected a size like `512MiB`, `2GiB` or a number of bytes, got `{text}`"))?;
    if !value.is_finite() || value < 0.0 {
        return Err(format!("a size cannot be negative, got `{text}`"));
    }
    let bytes = value * multiplier as f64;
    if bytes > u64::MAX as f64 {
        return Err(format!("size `{text}` is too large"));
    }
    Ok(bytes.round() as u64)
}

/// Render bytes with the largest binary unit that divides them exactly (`2GiB`, `1536MiB`).
pub fn format_size(bytes: u64) -> String {
    for (unit, mult) in SIZE_UNITS.iter().filter(|(u, _)| u.ends_with("iB")) {
        if bytes >= *mult && bytes.is_multiple_of(*mult) {
            return format!("{}{unit}", bytes / mult);
        }
    }
    format!("{bytes}B")
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format_size(self.0))
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_size(self.0))
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a size like `512MiB`, `2GiB` or a number of bytes")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v)
                    .map(ByteSize)
                    .map_err(|_| E::custom(format!("a size cannot be negative, got {v}")))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ByteSize, E> {
                parse_size(v).map(ByteSize).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// A duration; parses `250ms`, `5s`, `2m`, `1h`, `1.5s`; a bare number is milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct HumanDuration(pub Duration);

impl HumanDuration {
    /// The wrapped duration.
    pub fn get(self) -> Duration {
        self.0
    }
}

/// Parse a duration such as `250ms` or `5s`; a bare number is milliseconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    const UNITS: &[(&str, f64)] = &[
        ("ms", 1e-3),
        ("us", 1e-6),
        ("µs", 1e-6),
        ("s", 1.0),
        ("m", 60.0),
        ("h", 3600.0),
    ];
    let (number, seconds_per_unit) = UNITS
        .iter()
        .find_map(|(unit, mult)| text.strip_suffix(unit).map(|n| (n.trim(), *mult)))
        .unwrap_or((text, 1e-3));
    let value: f64 = number
        .parse()
        .map_err(|_| format!("expected a duration like `250ms`, `5s` or `2m`, got `{text}`"))?;
    if !value.is_finite() || value < 0.0 {
        return Err(format!("a duration cannot be negative, got `{text}`"));
    }
    Duration::try_from_secs_f64(value * seconds_per_unit).map_err(|_| format!("duration `{text}` is too large"))
}

/// Render a duration in the coarsest unit that represents it exactly.
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if !d.subsec_nanos().is_multiple_of(1_000_000) {
        format!("{}us", d.as_micros())
    } else if ms.is_multiple_of(3_600_000) && ms > 0 {
        format!("{}h", ms / 3_600_000)
    } else if ms.is_multiple_of(60_000) && ms > 0 {
        format!("{}m", ms / 60_000)
    } else if ms.is_multiple_of(1000) && ms > 0 {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format_duration(self.0))
    }
}

impl Serialize for HumanDuration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_duration(self.0))
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = HumanDuration;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a duration like `250ms`, `5s` or a number of milliseconds")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<HumanDuration, E> {
                Ok(HumanDuration(Duration::from_millis(v)))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<HumanDuration, E> {
                u64::try_from(v)
                    .map(|ms| HumanDuration(Duration::from_millis(ms)))
                    .map_err(|_| E::custom(format!("a duration cannot be negative, got {v}")))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<HumanDuration, E> {
                parse_duration(&v.to_string()).map(HumanDuration).map_err(E::custom)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<HumanDuration, E> {
                parse_duration(v).map(HumanDuration).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::yaml::parse_yaml;

    #[test]
    fn sizes_parse_binary_and_decimal_units() {
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("1GB"), Ok(1_000_000_000));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size(" 8 KiB "), Ok(8192));
        assert!(parse_size("lots").unwrap_err().contains("`lots`"));
        assert!(parse_size("-1MiB").unwrap_err().contains("negative"));
    }

    #[test]
    fn units_that_could_mean_two_things_are_refused_not_guessed() {
        // Decimal or binary? Bytes or bits? Minute or month? An error beats a guess.
        for ambiguous in ["512M", "2g", "1G", "512mb"] {
            assert!(parse_size(ambiguous).is_err(), "{ambiguous}");
        }
        assert!(parse_size("20000000TiB").unwrap_err().contains("too large"));
        assert!(parse_duration("1M").is_err());
    }

    #[test]
    fn sizes_format_with_the_largest_exact_unit() {
        assert_eq!(format_size(2 << 30), "2GiB");
        assert_eq!(format_size(1536 << 20), "1536MiB");
        assert_eq!(format_size(1000), "1000B");
    }

    #[test]
    fn durations_parse_units_and_bare_milliseconds() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("100"), Ok(Duration::from_millis(100)));
        assert!(parse_duration("soon").unwrap_err().contains("`soon`"));
        assert_eq!(format_duration(Duration::from_millis(1500)), "1500ms");
        assert_eq!(format_duration(Duration::from_secs(120)), "2m");
    }

    #[test]
    fn yaml_accepts_numbers_and_strings() {
        let s: ByteSize = parse_yaml("\"64MiB\"", "t.yaml").unwrap();
        assert_eq!(s.bytes(), 64 << 20);
        let s: ByteSize = parse_yaml("100", "t.yaml").unwrap();
        assert_eq!(s.bytes(), 100);
        let d: HumanDuration = parse_yaml("5s", "t.yaml").unwrap();
        assert_eq!(d.get(), Duration::from_secs(5));
        let err = parse_yaml::<ByteSize>("big", "t.yaml").unwrap_err().to_string();
        assert!(err.contains("`big`"), "{err}");
    }
}
