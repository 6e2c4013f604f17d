//! Tensors as the Open Inference Protocol carries them: a datatype name, a shape and flat
//! row-major data, decoded from JSON numbers (flat or nested) or little-endian bytes (the binary
//! tensor data extension). Pure code: no ONNX Runtime, no sockets.

use std::fmt;

use half::f16;
use serde::Serialize;
use serde::de::{self, DeserializeSeed, Deserializer, SeqAccess, Visitor};
use serde::ser::{SerializeSeq, Serializer};

/// The datatypes vramguard accepts (protocol names in [`DataType::name`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DataType {
    /// `BOOL`
    Bool,
    /// `UINT8`
    Uint8,
    /// `INT8`
    Int8,
    /// `INT16`
    Int16,
    /// `INT32`
    Int32,
    /// `INT64`
    Int64,
    /// `FP16`
    Fp16,
    /// `FP32`
    Fp32,
    /// `FP64`
    Fp64,
}

impl DataType {
    /// Every supported datatype.
    pub const ALL: [DataType; 9] = [
        DataType::Bool,
        DataType::Uint8,
        DataType::Int8,
        DataType::Int16,
        DataType::Int32,
        DataType::Int64,
        DataType::Fp16,
        DataType::Fp32,
        DataType::Fp64,
    ];

    /// The protocol name, e.g. `FP32`.
    pub fn name(self) -> &'static str {
        match self {
            DataType::Bool => "BOOL",
            DataType::Uint8 => "UINT8",
            DataType::Int8 => "INT8",
            DataType::Int16 => "INT16",
            DataType::Int32 => "INT32",
            DataType::Int64 => "INT64",
            DataType::Fp16 => "FP16",
            DataType::Fp32 => "FP32",
            DataType::Fp64 => "FP64",
        }
    }

    /// Parse a protocol name.
    pub fn from_name(name: &str) -> Option<DataType> {
        DataType::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Bytes per element in the binary extension.
    pub fn size(self) -> usize {
        match self {
            DataType::Bool | DataType::Uint8 | DataType::Int8 => 1,
            DataType::Int16 | DataType::Fp16 => 2,
            DataType::Int32 | DataType::Fp32 => 4,
            DataType::Int64 | DataType::Fp64 => 8,
        }
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Flat, typed tensor contents.
#[derive(Debug, Clone, PartialEq)]
pub enum TensorData {
    /// `BOOL`
    Bool(Vec<bool>),
    /// `UINT8`
    Uint8(Vec<u8>),
    /// `INT8`
    Int8(Vec<i8>),
    /// `INT16`
    Int16(Vec<i16>),
    /// `INT32`
    Int32(Vec<i32>),
    /// `INT64`
    Int64(Vec<i64>),
    /// `FP16`
    Fp16(Vec<f16>),
    /// `FP32`
    Fp32(Vec<f32>),
    /// `FP64`
    Fp64(Vec<f64>),
}

/// Applies `$body` to the vector inside any [`TensorData`] variant, binding it as `$v`.
macro_rules! each_variant {
    ($data:expr, $v:ident => $body:expr) => {
        match $data {
            TensorData::Bool($v) => $body,
            TensorData::Uint8($v) => $body,
            TensorData::Int8($v) => $body,
            TensorData::Int16($v) => $body,
            TensorData::Int32($v) => $body,
            TensorData::Int64($v) => $body,
            TensorData::Fp16($v) => $body,
            TensorData::Fp32($v) => $body,
            TensorData::Fp64($v) => $body,
        }
    };
}
pub(crate) use each_variant;

impl TensorData {
    /// Its datatype.
    pub fn datatype(&self) -> DataType {
        match self {
            TensorData::Bool(_) => DataType::Bool,
            TensorData::Uint8(_) => DataType::Uint8,
            TensorData::Int8(_) => DataType::Int8,
            TensorData::Int16(_) => DataType::Int16,
            TensorData::Int32(_) => DataType::Int32,
            TensorData::Int64(_) => DataType::Int64,
            TensorData::Fp16(_) => DataType::Fp16,
            TensorData::Fp32(_) => DataType::Fp32,
            TensorData::Fp64(_) => DataType::Fp64,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        each_variant!(self, v => v.len())
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `len` zeros (false for BOOL) of `dtype`.
    pub fn zeros(dtype: DataType, len: usize) -> TensorData {
        match dtype {
            DataType::Bool => TensorData::Bool(vec![false; len]),
            DataType::Uint8 => TensorData::Uint8(vec![0; len]),
            DataType::Int8 => TensorData::Int8(vec![0; len]),
            DataType::Int16 => TensorData::Int16(vec![0; len]),
            DataType::Int32 => TensorData::Int32(vec![0; len]),
            DataType::Int64 => TensorData::Int64(vec![0; len]),
            DataType::Fp16 => TensorData::Fp16(vec![f16::ZERO; len]),
            DataType::Fp32 => TensorData::Fp32(vec![0.0; len]),
            DataType::Fp64 => TensorData::Fp64(vec![0.0; len]),
        }
    }

    /// Decode JSON `data` (flat or nested arrays) as `dtype`.
    pub fn from_json(dtype: DataType, json: &str) -> Result<TensorData, String> {
        fn parse<T: Element>(json: &str) -> Result<Vec<T>, String> {
            match T::fast(json) {
                Some(fast) => Ok(fast),
                None => through_serde(json),
            }
        }
        Ok(match dtype {
            DataType::Bool => TensorData::Bool(parse(json)?),
            DataType::Uint8 => TensorData::Uint8(parse(json)?),
            DataType::Int8 => TensorData::Int8(parse(json)?),
            DataType::Int16 => TensorData::Int16(parse(json)?),
            DataType::Int32 => TensorData::Int32(parse(json)?),
            DataType::Int64 => TensorData::Int64(parse(json)?),
            DataType::Fp16 => TensorData::Fp16(parse(json)?),
            DataType::Fp32 => TensorData::Fp32(parse(json)?),
            DataType::Fp64 => TensorData::Fp64(parse(json)?),
        })
    }

    /// Decode little-endian bytes (binary tensor data extension) as `dtype`.
    pub fn from_le_bytes(dtype: DataType, bytes: &[u8]) -> Result<TensorData, String> {
        if !bytes.len().is_multiple_of(dtype.size()) {
            return Err(format!(
                "{} bytes is not a whole number of {dtype} elements ({} bytes each)",
                bytes.len(),
                dtype.size()
            ));
        }
        macro_rules! chunks {
            ($t:ty, $n:expr) => {
                bytes
                    .chunks_exact($n)
                    .map(|c| <$t>::from_le_bytes(c.try_into().expect("exact chunk")))
                    .collect()
            };
        }
        Ok(match dtype {
            DataType::Bool => TensorData::Bool(
                bytes
                    .iter()
                    .map(|b| match b {
                        0 => Ok(false),
                        1 => Ok(true),
                        other => Err(format!("BOOL bytes must be 0 or 1, got {other}")),
                    })
                    .collect::<Result<_, _>>()?,
            ),
            DataType::Uint8 => TensorData::Uint8(bytes.to_vec()),
            DataType::Int8 => TensorData::Int8(bytes.iter().map(|b| *b as i8).collect()),
            DataType::Int16 => TensorData::Int16(chunks!(i16, 2)),
            DataType::Int32 => TensorData::Int32(chunks!(i32, 4)),
            DataType::Int64 => TensorData::Int64(chunks!(i64, 8)),
            DataType::Fp16 => TensorData::Fp16(chunks!(f16, 2)),
            DataType::Fp32 => TensorData::Fp32(chunks!(f32, 4)),
            DataType::Fp64 => TensorData::Fp64(chunks!(f64, 8)),
        })
    }

    /// The first NaN or infinity of a floating-point tensor, with its element index: JSON has
    /// no way to write it.
    pub fn first_non_finite(&self) -> Option<(usize, f64)> {
        fn find<T: Copy + Into<f64>>(v: &[T]) -> Option<(usize, f64)> {
            v.iter()
                .map(|x| (*x).into())
                .enumerate()
                .find(|(_, x): &(usize, f64)| !x.is_finite())
        }
        match self {
            TensorData::Fp16(v) => v.iter().map(|x| x.to_f64()).enumerate().find(|(_, x)| !x.is_finite()),
            TensorData::Fp32(v) => find(v),
            TensorData::Fp64(v) => find(v),
            _ => None,
        }
    }

    /// Append the little-endian bytes of every element to `out`.
    pub fn write_le_bytes(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.resize(start + self.byte_len(), 0);
        self.write_le_bytes_to(&mut out[start..]);
    }

    /// How many bytes its little-endian encoding takes.
    pub fn byte_len(&self) -> usize {
        self.len() * self.datatype().size()
    }

    /// Write its little-endian bytes into `out`, which is [`byte_len`](Self::byte_len) long
    /// (shared memory another process reads, say).
    ///
    /// # Panics
    /// When `out` is not exactly that long.
    pub fn write_le_bytes_to(&self, out: &mut [u8]) {
        assert_eq!(out.len(), self.byte_len(), "a tensor's bytes fill exactly their place");
        // Element by element into fixed-size chunks: the compiler turns that into a plain copy
        // on a little-endian machine.
        macro_rules! fill {
            ($v:expr, $n:expr) => {{
                for (chunk, x) in out.chunks_exact_mut($n).zip($v.iter()) {
                    chunk.copy_from_slice(&x.to_le_bytes());
                }
            }};
        }
        match self {
            TensorData::Bool(v) => out.iter_mut().zip(v).for_each(|(o, b)| *o = *b as u8),
            TensorData::Uint8(v) => out.copy_from_slice(v),
            TensorData::Int8(v) => out.iter_mut().zip(v).for_each(|(o, b)| *o = *b as u8),
            TensorData::Int16(v) => fill!(v, 2),
            TensorData::Int32(v) => fill!(v, 4),
            TensorData::Int64(v) => fill!(v, 8),
            TensorData::Fp16(v) => fill!(v, 2),
            TensorData::Fp32(v) => fill!(v, 4),
            TensorData::Fp64(v) => fill!(v, 8),
        }
    }
}

impl Serialize for TensorData {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            // FP16 travels as JSON numbers; half's own serde impl would write the raw bits.
            TensorData::Fp16(v) => {
                let mut seq = s.serialize_seq(Some(v.len()))?;
                for x in v {
                    seq.serialize_element(&x.to_f32())?;
                }
                seq.end()
            }
            TensorData::Bool(v) => v.serialize(s),
            TensorData::Uint8(v) => v.serialize(s),
            TensorData::Int8(v) => v.serialize(s),
            TensorData::Int16(v) => v.serialize(s),
            TensorData::Int32(v) => v.serialize(s),
            TensorData::Int64(v) => v.serialize(s),
            TensorData::Fp32(v) => v.serialize(s),
            TensorData::Fp64(v) => v.serialize(s),
        }
    }
}

/// A named tensor whose little-endian bytes lie elsewhere (a worker process's shared memory),
/// borrowed: a backend may run on them where they are.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    /// Input name.
    pub name: &'a str,
    /// Element type.
    pub datatype: DataType,
    /// Dimensions.
    pub shape: &'a [i64],
    /// Its elements' bytes: exactly the shape's element count times the type's size.
    pub bytes: &'a [u8],
}

impl TensorView<'_> {
    /// The tensor, its bytes decoded (copied).
    pub fn to_tensor(&self) -> Result<Tensor, String> {
        Ok(Tensor {
            name: self.name.to_string(),
            shape: self.shape.to_vec(),
            data: TensorData::from_le_bytes(self.datatype, self.bytes)?,
        })
    }
}

/// A named tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    /// Input or output name.
    pub name: String,
    /// Dimensions.
    pub shape: Vec<i64>,
    /// Flat row-major contents.
    pub data: TensorData,
}

impl Tensor {
    /// Element count implied by a shape, `None` on negative dims or overflow.
    pub fn element_count(shape: &[i64]) -> Option<usize> {
        shape.iter().try_fold(1usize, |acc, &d| {
            usize::try_from(d).ok().and_then(|d| acc.checked_mul(d))
        })
    }

    /// Keep `keep` entries of `axis` (the first ones or the last ones), dropping the rest.
    /// Used to shrink a context axis; `keep` must not exceed the axis length.
    pub fn truncate_axis(&mut self, axis: usize, keep: usize, keep_end: bool) {
        let len = self.shape[axis] as usize;
        let keep = keep.min(len);
        let outer: usize = self.shape[..axis].iter().map(|d| *d as usize).product();
        let inner: usize = self.shape[axis + 1..].iter().map(|d| *d as usize).product();
        let start = if keep_end { len - keep } else { 0 };
        each_variant!(&mut self.data, v => {
            let mut out = Vec::with_capacity(outer * keep * inner);
            for o in 0..outer {
                let base = o * len * inner;
                out.extend_from_slice(&v[base + start * inner..base + (start + keep) * inner]);
            }
            *v = out;
        });
        self.shape[axis] = keep as i64;
    }
}

/// An element type JSON numbers or booleans can be decoded into, with range checks.
trait Element: Sized {
    const NAME: &'static str;
    fn from_u64(v: u64) -> Option<Self>;
    fn from_i64(v: i64) -> Option<Self>;
    fn from_f64(v: f64) -> Option<Self>;
    fn from_bool(_: bool) -> Option<Self> {
        None
    }
    /// The common case decoded without serde (see [`json::numbers`]); `None` to take the serde path.
    fn fast(_json: &str) -> Option<Vec<Self>> {
        None
    }
}

/// `json`'s numbers through serde: every document the codec accepts, and the message for every
/// one it refuses.
fn through_serde<T: Element>(json: &str) -> Result<Vec<T>, String> {
    let mut out = Vec::new();
    let mut de = serde_json::Deserializer::from_str(json);
    Flatten(&mut out)
        .deserialize(&mut de)
        .and_then(|()| de.end())
        .map_err(|e| {
            // serde_json appends "at line 1 column N", which means nothing to the client for an
            // embedded fragment; keep the reason only.
            let msg = e.to_string();
            msg.split(" at line ").next().unwrap_or(&msg).to_string()
        })?;
    Ok(out)
}

macro_rules! int_element {
    ($t:ty, $name:literal) => {
        impl json::Scan for $t {
            fn scan(bytes: &[u8], at: usize) -> Option<(Self, usize)> {
                json::integer(bytes, at)
            }
        }
        impl Element for $t {
            const NAME: &'static str = $name;
            fn from_u64(v: u64) -> Option<Self> {
                <$t>::try_from(v).ok()
            }
            fn from_i64(v: i64) -> Option<Self> {
                <$t>::try_from(v).ok()
            }
            fn from_f64(v: f64) -> Option<Self> {
                // `3.0` is an integer written as a float; `3.5` is not.
                (v.fract() == 0.0 && v >= <$t>::MIN as f64 && v <= <$t>::MAX as f64).then(|| v as $t)
            }
            fn fast(json: &str) -> Option<Vec<Self>> {
                json::numbers::<$t>(json)
            }
        }
    };
}
int_element!(u8, "UINT8");
int_element!(i8, "INT8");
int_element!(i16, "INT16");
int_element!(i32, "INT32");
int_element!(i64, "INT64");

macro_rules! float_element {
    ($t:ty, $name:literal, $from:expr $(, $fast:ident)?) => {
        impl Element for $t {
            const NAME: &'static str = $name;
            fn from_u64(v: u64) -> Option<Self> {
                $from(v as f64)
            }
            fn from_i64(v: i64) -> Option<Self> {
                $from(v as f64)
            }
            fn from_f64(v: f64) -> Option<Self> {
                $from(v)
            }
            $(
                fn $fast(json: &str) -> Option<Vec<Self>> {
                    // Decimal text to the nearest value of the type, in one rounding (through
                    // f64 it would be two); an infinite result is a number too large for it.
                    json::numbers::<$t>(json)
                }
            )?
        }
    };
}
/// A JSON number in the type's range (JSON has no infinities, so an infinite result means the
/// number was too large for the type, e.g. `1e39` for FP32).
fn finite<T>(v: T, is_finite: impl Fn(&T) -> bool) -> Option<T> {
    is_finite(&v).then_some(v)
}
float_element!(f32, "FP32", |v: f64| finite(v as f32, |x| x.is_finite()), fast);
float_element!(f64, "FP64", |v: f64| finite(v, |x| x.is_finite()), fast);
float_element!(f16, "FP16", |v: f64| finite(f16::from_f64(v), |x| x.is_finite()));

impl Element for bool {
    const NAME: &'static str = "BOOL";
    fn from_u64(_: u64) -> Option<Self> {
        None
    }
    fn from_i64(_: i64) -> Option<Self> {
        None
    }
    fn from_f64(_: f64) -> Option<Self> {
        None
    }
    fn from_bool(v: bool) -> Option<Self> {
        Some(v)
    }
}

/// Deserializes arbitrarily nested JSON arrays straight into one flat vector, without building
/// a `serde_json::Value` tree (the request path decodes tens of thousands of numbers).
struct Flatten<'a, T>(&'a mut Vec<T>);

impl<'de, T: Element> DeserializeSeed<'de> for Flatten<'_, T> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<T: Element> Flatten<'_, T> {
    fn push<E: de::Error>(self, v: Option<T>, shown: impl fmt::Display) -> Result<(), E> {
        match v {
            Some(v) => {
                self.0.push(v);
                Ok(())
            }
            None => Err(E::custom(format!(
                "value {shown} is not a valid {} element (element {})",
                T::NAME,
                self.0.len()
            ))),
        }
    }
}

impl<'de, T: Element> Visitor<'de> for Flatten<'_, T> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "an array of {} values", T::NAME)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        if let Some(hint) = seq.size_hint() {
            self.0.reserve(hint);
        }
        while seq.next_element_seed(Flatten(&mut *self.0))?.is_some() {}
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        self.push(T::from_u64(v), v)
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        self.push(T::from_i64(v), v)
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        // Debug writes `1e39`, not forty digits.
        self.push(T::from_f64(v), format_args!("{v:?}"))
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<(), E> {
        self.push(T::from_bool(v), v)
    }
}

mod bytes;
mod json;

#[cfg(test)]
mod json_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_flat_and_nested_decode_the_same() {
        let flat = TensorData::from_json(DataType::Fp32, "[1, 2.5, -3, 4]").unwrap();
        let nested = TensorData::from_json(DataType::Fp32, "[[1, 2.5], [-3, 4]]").unwrap();
        assert_eq!(flat, TensorData::Fp32(vec![1.0, 2.5, -3.0, 4.0]));
        assert_eq!(flat, nested);
    }

    #[test]
    fn json_values_outside_the_type_are_refused_with_position() {
        let err = TensorData::from_json(DataType::Uint8, "[1, 300]").unwrap_err();
        assert_eq!(err, "value 300 is not a valid UINT8 element (element 1)");
        let err = TensorData::from_json(DataType::Int32, "[1.5]").unwrap_err();
        assert!(err.contains("1.5 is not a valid INT32"), "{err}");
        let err = TensorData::from_json(DataType::Bool, "[1]").unwrap_err();
        assert!(err.contains("not a valid BOOL"), "{err}");
        let err = TensorData::from_json(DataType::Fp32, "[\"x\"]").unwrap_err();
        assert!(err.contains("array of FP32"), "{err}");
        assert_eq!(
            TensorData::from_json(DataType::Int64, "[3.0, -9007199254740993]").unwrap(),
            TensorData::Int64(vec![3, -9007199254740993])
        );
    }

    #[test]
    fn bytes_round_trip_every_type() {
        let cases = [
            TensorData::Bool(vec![true, false]),
            TensorData::Uint8(vec![0, 255]),
            TensorData::Int8(vec![-128, 127]),
            TensorData::Int16(vec![-2, 300]),
            TensorData::Int32(vec![i32::MIN, 7]),
            TensorData::Int64(vec![i64::MAX, -1]),
            TensorData::Fp16(vec![f16::from_f32(1.5), f16::from_f32(-0.25)]),
            TensorData::Fp32(vec![1.25, -7.0]),
            TensorData::Fp64(vec![1e300, -0.5]),
        ];
        for data in cases {
            let mut bytes = Vec::new();
            data.write_le_bytes(&mut bytes);
            assert_eq!(bytes.len(), 2 * data.datatype().size());
            assert_eq!(TensorData::from_le_bytes(data.datatype(), &bytes).unwrap(), data);
        }
        let err = TensorData::from_le_bytes(DataType::Fp32, &[0; 6]).unwrap_err();
        assert!(err.contains("6 bytes"), "{err}");
    }

    #[test]
    fn fp16_serializes_as_numbers() {
        let data = TensorData::Fp16(vec![f16::from_f32(0.5)]);
        assert_eq!(serde_json::to_string(&data).unwrap(), "[0.5]");
    }

    #[test]
    fn truncate_axis_keeps_the_chosen_end() {
        let mut t = Tensor {
            name: "x".into(),
            shape: vec![2, 3, 2],
            data: TensorData::Int32((0..12).collect()),
        };
        let mut start = t.clone();
        t.truncate_axis(1, 2, true);
        assert_eq!(t.shape, vec![2, 2, 2]);
        assert_eq!(t.data, TensorData::Int32(vec![2, 3, 4, 5, 8, 9, 10, 11]));
        start.truncate_axis(1, 1, false);
        assert_eq!(start.data, TensorData::Int32(vec![0, 1, 6, 7]));
    }
}
