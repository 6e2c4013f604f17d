//! The tensor work of a batch: members' inputs right-padded with zeros to the longest along
//! every axis but the batch axis and stacked along it, and each member's rows cut back out of
//! the outputs, padded positions trimmed. Pure: no service, no runtime.

use std::collections::HashMap;

use crate::core::tensor::{Tensor, TensorData, each_variant};

/// `outer` (the product of the axes before `axis`), the axis' length and `inner` (the product
/// of those after it).
fn split(shape: &[i64], axis: usize) -> (usize, usize, usize) {
    let size = |dims: &[i64]| dims.iter().map(|d| (*d).max(0) as usize).product::<usize>();
    (
        size(&shape[..axis]),
        shape[axis].max(0) as usize,
        size(&shape[axis + 1..]),
    )
}

/// `tensor` with axis `axis` grown to `len`, the new positions zeros (false).
fn pad_axis(tensor: &Tensor, axis: usize, len: usize) -> Tensor {
    let (outer, have, inner) = split(&tensor.shape, axis);
    let mut data = tensor.data.clone();
    each_variant!(&mut data, v => {
        let mut out = Vec::with_capacity(outer * len * inner);
        for o in 0..outer {
            out.extend_from_slice(&v[o * have * inner..(o + 1) * have * inner]);
            out.resize(out.len() + (len - have) * inner, Default::default());
        }
        *v = out;
    });
    let mut shape = tensor.shape.clone();
    shape[axis] = len as i64;
    Tensor {
        name: tensor.name.clone(),
        shape,
        data,
    }
}

/// The same variant of two [`TensorData`]s, bound as `$x` (mutable) and `$y`; `$other` when
/// they differ.
macro_rules! same_variant {
    ($a:expr, $b:expr, $x:ident, $y:ident => $body:expr, $other:expr) => {
        match ($a, $b) {
            (TensorData::Bool($x), TensorData::Bool($y)) => $body,
            (TensorData::Uint8($x), TensorData::Uint8($y)) => $body,
            (TensorData::Int8($x), TensorData::Int8($y)) => $body,
            (TensorData::Int16($x), TensorData::Int16($y)) => $body,
            (TensorData::Int32($x), TensorData::Int32($y)) => $body,
            (TensorData::Int64($x), TensorData::Int64($y)) => $body,
            (TensorData::Fp16($x), TensorData::Fp16($y)) => $body,
            (TensorData::Fp32($x), TensorData::Fp32($y)) => $body,
            (TensorData::Fp64($x), TensorData::Fp64($y)) => $body,
            _ => $other,
        }
    };
}

/// `parts` (equal in every axis but `axis`, and in type) stacked along `axis`.
fn concat(parts: &[Tensor], axis: usize) -> Result<Tensor, String> {
    let first = &parts[0];
    let mut shape = first.shape.clone();
    shape[axis] = parts.iter().map(|p| p.shape[axis]).sum();
    let (outer, _, inner) = split(&first.shape, axis);
    let mut data = TensorData::zeros(first.data.datatype(), 0);
    for o in 0..outer {
        for part in parts {
            let len = split(&part.shape, axis).1;
            let slab = o * len * inner..(o + 1) * len * inner;
            same_variant!(&mut data, &part.data, out, v => out.extend_from_slice(&v[slab]),
                return Err(format!("input `{}` has different element types in the batch", first.name)));
        }
    }
    Ok(Tensor {
        name: first.name.clone(),
        shape,
        data,
    })
}

/// The members' inputs as one batch: each input, by name, right-padded with zeros to the
/// longest along every axis but its batch axis (`batch_axis(name)`), then stacked along it in
/// the members' order. Every member has the same inputs (names, ranks and types).
pub(super) fn merge(members: &[&[Tensor]], batch_axis: &dyn Fn(&str) -> usize) -> Result<Vec<Tensor>, String> {
    let first = members.first().ok_or("a batch has members")?;
    first
        .iter()
        .map(|input| {
            let axis = batch_axis(&input.name);
            let parts: Vec<&Tensor> = members
                .iter()
                .map(|m| {
                    m.iter()
                        .find(|t| t.name == input.name && t.shape.len() == input.shape.len())
                        .ok_or_else(|| format!("a member has no input `{}` of rank {}", input.name, input.shape.len()))
                })
                .collect::<Result<_, _>>()?;
            if parts.iter().any(|p| p.data.datatype() != input.data.datatype()) {
                return Err(format!(
                    "input `{}` has different element types in the batch",
                    input.name
                ));
            }
            let longest: Vec<i64> = (0..input.shape.len())
                .map(|k| parts.iter().map(|p| p.shape[k]).max().unwrap_or(0))
                .collect();
            let padded: Vec<Tensor> = parts
                .iter()
                .map(|part| {
                    let mut tensor = (*part).clone();
                    for (k, &len) in longest.iter().enumerate() {
                        if k != axis && tensor.shape[k] < len {
                            tensor = pad_axis(&tensor, k, len as usize);
                        }
                    }
                    tensor
                })
                .collect();
            concat(&padded, axis)
        })
        .collect()
}

/// One member's answer out of the batch's `outputs`: rows `start..start + rows` along each
/// output's first axis (the batch axis, `total` rows long), and every later axis whose symbol
/// is in `lengths` (the member's own length along an axis of its inputs, by symbol) cut back
/// to that length, so the padding the batch added is gone. `symbols(name)` gives an output's
/// axis symbols as the model declares them.
pub(super) fn cut(
    outputs: &[Tensor],
    (start, rows, total): (usize, usize, usize),
    lengths: &HashMap<String, usize>,
    symbols: &dyn Fn(&str) -> Vec<String>,
) -> Result<Vec<Tensor>, String> {
    outputs
        .iter()
        .map(|output| {
            if output.shape.first().map(|d| *d as usize) != Some(total) {
                return Err(format!(
                    "output `{}` of shape {:?} does not have the batch's {total} rows first",
                    output.name, output.shape
                ));
            }
            let (_, _, inner) = split(&output.shape, 0);
            let mut data = output.data.clone();
            each_variant!(&mut data, v => *v = v[start * inner..(start + rows) * inner].to_vec());
            let mut shape = output.shape.clone();
            shape[0] = rows as i64;
            let mut mine = Tensor {
                name: output.name.clone(),
                shape,
                data,
            };
            for (k, symbol) in symbols(&output.name).iter().enumerate().skip(1) {
                if let Some(&len) = lengths.get(symbol)
                    && k < mine.shape.len()
                    && (len as i64) < mine.shape[k]
                {
                    mine.truncate_axis(k, len, false);
                }
            }
            Ok(mine)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(name: &str, shape: Vec<i64>, values: Vec<i64>) -> Tensor {
        Tensor {
            name: name.into(),
            shape,
            data: TensorData::Int64(values),
        }
    }

    #[test]
    fn members_are_right_padded_to_the_longest_and_stacked_in_order() {
        let a = [
            ids("input_ids", vec![1, 2], vec![1, 2]),
            ids("attention_mask", vec![1, 2], vec![1, 1]),
        ];
        let b = [
            ids("input_ids", vec![2, 3], vec![3, 4, 5, 6, 7, 8]),
            ids("attention_mask", vec![2, 3], vec![1, 1, 1, 1, 1, 1]),
        ];
        let merged = merge(&[&a, &b], &|_| 0).unwrap();
        assert_eq!(merged[0], ids("input_ids", vec![3, 3], vec![1, 2, 0, 3, 4, 5, 6, 7, 8]));
        // The padding is masked out: what keeps the answers exact.
        assert_eq!(
            merged[1],
            ids("attention_mask", vec![3, 3], vec![1, 1, 0, 1, 1, 1, 1, 1, 1])
        );
    }

    #[test]
    fn a_batch_axis_that_is_not_first_stacks_there() {
        let a = [ids("x", vec![2, 1], vec![1, 2])];
        let b = [ids("x", vec![2, 1], vec![3, 4])];
        let merged = merge(&[&a, &b], &|_| 1).unwrap();
        assert_eq!(merged[0], ids("x", vec![2, 2], vec![1, 3, 2, 4]));
    }

    #[test]
    fn members_of_different_types_do_not_merge() {
        let a = [ids("x", vec![1, 1], vec![1])];
        let b = [Tensor {
            name: "x".into(),
            shape: vec![1, 1],
            data: TensorData::Fp32(vec![1.0]),
        }];
        assert!(merge(&[&a, &b], &|_| 0).unwrap_err().contains("element types"));
    }

    #[test]
    fn each_member_gets_its_rows_with_the_padding_trimmed() {
        // [3 rows, 3 positions, 2 features]: row 0 is the first member's (2 positions of its
        // own), rows 1-2 the second's (3 positions).
        let hidden = Tensor {
            name: "last_hidden_state".into(),
            shape: vec![3, 3, 2],
            data: TensorData::Fp32((0..18).map(|v| v as f32).collect()),
        };
        let pooled = Tensor {
            name: "pooled".into(),
            shape: vec![3, 2],
            data: TensorData::Fp32((0..6).map(|v| v as f32).collect()),
        };
        let symbols = |name: &str| match name {
            "last_hidden_state" => vec!["batch".to_string(), "sequence".to_string(), String::new()],
            _ => vec!["batch".to_string(), String::new()],
        };
        let outputs = [hidden, pooled];
        let first = cut(
            &outputs,
            (0, 1, 3),
            &HashMap::from([("sequence".to_string(), 2)]),
            &symbols,
        )
        .unwrap();
        assert_eq!(first[0].shape, vec![1, 2, 2]);
        assert_eq!(first[0].data, TensorData::Fp32(vec![0.0, 1.0, 2.0, 3.0]));
        assert_eq!(first[1].data, TensorData::Fp32(vec![0.0, 1.0]));
        let second = cut(
            &outputs,
            (1, 2, 3),
            &HashMap::from([("sequence".to_string(), 3)]),
            &symbols,
        )
        .unwrap();
        assert_eq!(second[0].shape, vec![2, 3, 2]);
        assert_eq!(second[0].data, TensorData::Fp32((6..18).map(|v| v as f32).collect()));
        assert_eq!(second[1].data, TensorData::Fp32(vec![2.0, 3.0, 4.0, 5.0]));
    }

    #[test]
    fn an_output_without_the_batch_first_is_refused() {
        let scalar = Tensor {
            name: "s".into(),
            shape: vec![1],
            data: TensorData::Fp32(vec![1.0]),
        };
        assert!(cut(&[scalar], (0, 1, 2), &HashMap::new(), &|_| vec![]).is_err());
    }
}
