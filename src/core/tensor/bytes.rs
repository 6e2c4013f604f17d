//! A tensor's elements seen as the little-endian bytes they already are in memory, so a run can
//! borrow them ([`Tensor::view`]) instead of copying them.

use super::{Tensor, TensorData, TensorView};

impl TensorData {
    /// Its elements' little-endian bytes where they lie, without a copy; `None` on a big-endian
    /// machine, where the bytes in memory are not the little-endian ones.
    #[allow(unsafe_code)]
    pub fn as_le_bytes(&self) -> Option<&[u8]> {
        if cfg!(target_endian = "big") {
            return None;
        }
        fn bytes<T>(v: &[T]) -> &[u8] {
            // SAFETY: only called below, on slices of `bool`, integers, `f16`, `f32` and `f64`:
            // types without padding whose every element is initialised, so each of their bytes
            // is an initialised `u8`; `u8` needs no alignment; the slice borrows `v` for as long
            // as `v` is borrowed and covers exactly its `size_of_val` bytes.
            unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
        }
        Some(match self {
            TensorData::Bool(v) => bytes(v),
            TensorData::Uint8(v) => v,
            TensorData::Int8(v) => bytes(v),
            TensorData::Int16(v) => bytes(v),
            TensorData::Int32(v) => bytes(v),
            TensorData::Int64(v) => bytes(v),
            TensorData::Fp16(v) => bytes(v),
            TensorData::Fp32(v) => bytes(v),
            TensorData::Fp64(v) => bytes(v),
        })
    }
}

impl Tensor {
    /// The tensor borrowed as a [`TensorView`], for a backend that runs on bytes where they lie;
    /// `None` where its bytes are not little-endian in memory.
    pub fn view(&self) -> Option<TensorView<'_>> {
        Some(TensorView {
            name: &self.name,
            datatype: self.data.datatype(),
            shape: &self.shape,
            bytes: self.data.as_le_bytes()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    #[test]
    fn a_view_reads_back_as_the_same_tensor_for_every_type() {
        for data in [
            TensorData::Bool(vec![true, false, true]),
            TensorData::Uint8(vec![0, 7, 255]),
            TensorData::Int8(vec![-128, 0, 127]),
            TensorData::Int16(vec![-2, 300, i16::MAX]),
            TensorData::Int32(vec![-1, 1 << 20, i32::MIN]),
            TensorData::Int64(vec![-1, 1 << 40, i64::MAX]),
            TensorData::Fp16(vec![f16::from_f32(-0.5), f16::from_f32(65504.0), f16::from_f32(1e-3)]),
            TensorData::Fp32(vec![-0.3, 1e30, f32::MIN_POSITIVE]),
            TensorData::Fp64(vec![-0.3, 1e300, f64::EPSILON]),
        ] {
            let tensor = Tensor {
                name: "x".into(),
                shape: vec![1, 3],
                data,
            };
            let view = tensor.view().expect("this machine is little-endian");
            assert_eq!(view.bytes.len(), tensor.data.byte_len());
            let mut written = Vec::new();
            tensor.data.write_le_bytes(&mut written);
            assert_eq!(view.bytes, &written[..], "{:?}", tensor.data.datatype());
            assert_eq!(view.to_tensor().unwrap(), tensor);
        }
    }
}
