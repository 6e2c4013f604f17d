//! The kernels' graphs checked against plain Rust: padding, joining, picking and trimming
//! caches and masks, on the graphs and on the host.

use super::*;
use crate::runtime::decoder::Padding;
use crate::runtime::onnx::runtime;
use half::f16;

/// Kernels that run their graphs, as on a CUDA pool.
fn kernels() -> Kernels {
    Kernels {
        graphs_only: true,
        ..on_host()
    }
}

/// Kernels as a CPU pool has them: values on the host are read and built in place.
fn on_host() -> Kernels {
    let rt = runtime(None).expect("ONNX Runtime loads");
    Kernels::new(rt, &SessionOptions::quiet_cpu()).expect("kernels")
}

#[test]
fn on_the_host_masks_and_last_positions_are_the_graphs_answers() {
    let (mut graphs, mut host) = (kernels(), on_host());
    let mask = value(&[3, 5], (0..15).map(|i| i64::from(i % 4 != 0)).collect());
    let column = value(&[3, 1], vec![1i64, 0, 1]);
    let by_graph = read::<i64>(&graphs.concat(&mask, &column, 1).unwrap());
    assert_eq!(read::<i64>(&host.concat(&mask, &column, 1).unwrap()), by_graph);
    assert_eq!(by_graph.0, vec![3, 6]);
    let logits = value(&[2, 3, 4], (0..24).map(|i| i as f32 * 0.5).collect());
    let rows = graphs.last_position(&logits).unwrap();
    assert_eq!(host.last_position(&logits).unwrap(), rows);
    assert_eq!(rows, vec![4.0, 4.5, 5.0, 5.5, 10.0, 10.5, 11.0, 11.5]);
}

fn value<T>(shape: &[i64], data: Vec<T>) -> DynValue
where
    T: ort::value::PrimitiveTensorElementType + std::fmt::Debug + Clone + 'static,
{
    ort::value::Tensor::from_array((shape.to_vec(), data))
        .expect("a tensor")
        .into_dyn()
}

fn read<T: ort::value::PrimitiveTensorElementType + Clone>(value: &DynValue) -> (Vec<i64>, Vec<T>) {
    let (shape, data) = value.try_extract_tensor::<T>().expect("extracts");
    (shape.iter().copied().collect(), data.to_vec())
}

/// Every multi-index of `shape`, row-major.
fn indices(shape: &[i64]) -> Vec<Vec<i64>> {
    let mut all = vec![vec![]];
    for &size in shape {
        all = all
            .into_iter()
            .flat_map(|prefix: Vec<i64>| {
                (0..size).map(move |i| {
                    let mut next = prefix.clone();
                    next.push(i);
                    next
                })
            })
            .collect();
    }
    all
}

fn offset(shape: &[i64], index: &[i64]) -> usize {
    index
        .iter()
        .zip(shape)
        .fold(0, |acc, (&i, &n)| acc * n as usize + i as usize)
}

/// What `arrange` computes, in plain Rust: each part `(shape, data, pad)` padded with zeros on
/// `along`'s side of its axis, rows joined, `rows` taken, positions `along.keep` kept.
fn reference<T: Copy + Default>(parts: &[(&[i64], &[T], i64)], rows: &[i64], along: &Along) -> (Vec<i64>, Vec<T>) {
    let axis = along.axis;
    let (first, _, first_pad) = parts[0];
    let length = first[axis] + first_pad;
    let mut row_shape = first[1..].to_vec();
    row_shape[axis - 1] = length;
    let mut joined: Vec<Vec<T>> = Vec::new();
    for &(shape, data, pad) in parts {
        for row in 0..shape[0] {
            let padded = indices(&row_shape)
                .iter()
                .map(|index| {
                    let mut source = vec![row];
                    source.extend_from_slice(index);
                    if along.side == Padding::Left {
                        source[axis] -= pad;
                    }
                    if source[axis] < 0 || source[axis] >= shape[axis] {
                        T::default()
                    } else {
                        data[offset(shape, &source)]
                    }
                })
                .collect();
            joined.push(padded);
        }
    }
    let (start, end) = (along.keep.start, along.keep.end.min(length));
    let mut kept_shape = row_shape.clone();
    kept_shape[axis - 1] = end - start;
    let mut out = Vec::new();
    for &row in rows {
        for index in indices(&kept_shape) {
            let mut source = index.clone();
            source[axis - 1] += start;
            out.push(joined[row as usize][offset(&row_shape, &source)]);
        }
    }
    let mut shape = vec![rows.len() as i64];
    shape.extend(kept_shape);
    (shape, out)
}

fn counting(n: i64, from: f32) -> Vec<f32> {
    (0..n).map(|i| from + i as f32).collect()
}

#[test]
fn arrange_pads_joins_picks_and_trims_fp32_caches() {
    let mut kernels = kernels();
    let (a_shape, b_shape) = ([2, 2, 3, 2], [3, 2, 4, 2]);
    let a_data = counting(24, 1.0);
    let b_data = counting(48, 101.0);
    let (a, b) = (value(&a_shape, a_data.clone()), value(&b_shape, b_data.clone()));
    for (rows, start) in [(vec![4, 0, 2], 1), (vec![0, 1, 2, 3, 4], 0), (vec![3], 4)] {
        let out = kernels
            .arrange(&a, 1, Some((&b, 0)), &rows, Along::left(2, start))
            .expect("arranges");
        assert_eq!(out.dtype().tensor_type(), Some(TensorElementType::Float32));
        let expected = reference(
            &[(&a_shape, &a_data, 1), (&b_shape, &b_data, 0)],
            &rows,
            &Along::left(2, start),
        );
        assert_eq!(read::<f32>(&out), expected, "rows {rows:?}, start {start}");
    }
    // The reference itself pads on the left: a's first row, first head, starts with zeros.
    let (_, padded) = reference(
        &[(&a_shape, &a_data, 1), (&b_shape, &b_data, 0)],
        &[0],
        &Along::left(2, 0),
    );
    assert_eq!(&padded[..4], &[0.0, 0.0, 1.0, 2.0]);
}

#[test]
fn arrange_pads_on_the_right_and_keeps_the_head_of_the_axis() {
    let mut kernels = kernels();
    let (a_shape, b_shape) = ([2, 2, 3, 2], [3, 2, 5, 2]);
    let a_data = counting(24, 1.0);
    let b_data = counting(60, 101.0);
    let (a, b) = (value(&a_shape, a_data.clone()), value(&b_shape, b_data.clone()));
    for (rows, end) in [
        (vec![4, 0, 2], 5),
        (vec![0, 1], 3),
        (vec![3], 4),
        (vec![1, 3], i64::MAX),
    ] {
        let along = Along::right(2, end);
        let out = kernels
            .arrange(&a, 2, Some((&b, 0)), &rows, along.clone())
            .expect("arranges");
        let expected = reference(&[(&a_shape, &a_data, 2), (&b_shape, &b_data, 0)], &rows, &along);
        assert_eq!(read::<f32>(&out), expected, "rows {rows:?}, end {end}");
    }
    // The reference pads on the right: a's first row, first head, ends with zeros.
    let (_, padded) = reference(
        &[(&a_shape, &a_data, 2), (&b_shape, &b_data, 0)],
        &[0],
        &Along::right(2, 5),
    );
    assert_eq!(&padded[..10], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.0, 0.0, 0.0, 0.0]);
}

#[test]
fn arrange_without_b_pads_and_picks_a_alone() {
    let mut kernels = kernels();
    let shape = [3, 2, 3, 2];
    let data = counting(36, 1.0);
    let a = value(&shape, data.clone());
    for (rows, start) in [(vec![2, 0], 0), (vec![1], 3), (vec![0, 1, 2], 5), (vec![2, 2], 2)] {
        let out = kernels
            .arrange(&a, 2, None, &rows, Along::left(2, start))
            .expect("arranges");
        let expected = reference(&[(&shape, &data, 2)], &rows, &Along::left(2, start));
        assert_eq!(read::<f32>(&out), expected, "rows {rows:?}, start {start}");
    }
}

#[test]
fn arrange_takes_int64_masks_on_axis_1_and_fp16_caches() {
    let mut kernels = kernels();
    let (a_data, b_data) = (vec![1i64, 1, 1, 0, 1, 1], vec![1i64, 1, 1, 1, 1]);
    let (a, b) = (value(&[2, 3], a_data.clone()), value(&[1, 5], b_data.clone()));
    let out = kernels
        .arrange(&a, 2, Some((&b, 0)), &[2, 1, 0], Along::left(1, 1))
        .expect("arranges");
    assert_eq!(out.dtype().tensor_type(), Some(TensorElementType::Int64));
    let expected = reference(
        &[(&[2, 3], &a_data, 2), (&[1, 5], &b_data, 0)],
        &[2, 1, 0],
        &Along::left(1, 1),
    );
    assert_eq!(read::<i64>(&out), expected);
    assert_eq!(expected.1, [1, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1]);

    let (a_shape, b_shape) = ([1, 2, 2, 4], [2, 2, 3, 4]);
    let a_data: Vec<f16> = counting(16, 0.5).into_iter().map(f16::from_f32).collect();
    let b_data: Vec<f16> = counting(48, -20.0).into_iter().map(f16::from_f32).collect();
    let (a, b) = (value(&a_shape, a_data.clone()), value(&b_shape, b_data.clone()));
    let out = kernels
        .arrange(&a, 1, Some((&b, 0)), &[1, 0], Along::left(2, 1))
        .expect("arranges");
    assert_eq!(out.dtype().tensor_type(), Some(TensorElementType::Float16));
    let expected = reference(
        &[(&a_shape, &a_data, 1), (&b_shape, &b_data, 0)],
        &[1, 0],
        &Along::left(2, 1),
    );
    assert_eq!(read::<f16>(&out), expected);
}

#[test]
fn arrange_takes_empty_row_sets_and_zero_row_inputs() {
    let mut kernels = kernels();
    let a_data = counting(12, 1.0);
    let a = value(&[2, 1, 3, 2], a_data.clone());
    let none = value(&[0, 1, 4, 2], Vec::<f32>::new());
    let out = kernels.arrange(&a, 0, None, &[], Along::left(2, 1)).expect("no rows");
    assert_eq!(read::<f32>(&out), (vec![0, 1, 2, 2], vec![]));
    // An empty b: only a's rows exist.
    let out = kernels
        .arrange(&a, 1, Some((&none, 0)), &[1], Along::left(2, 0))
        .expect("empty b");
    let expected = reference(&[(&[2, 1, 3, 2], &a_data, 1)], &[1], &Along::left(2, 0));
    assert_eq!(read::<f32>(&out), expected);
    // An empty a: b's rows start at 0.
    let out = kernels
        .arrange(&none, 0, Some((&a, 1)), &[0, 1], Along::left(2, 0))
        .expect("empty a");
    let expected = reference(&[(&[2, 1, 3, 2], &a_data, 1)], &[0, 1], &Along::left(2, 0));
    assert_eq!(read::<f32>(&out), expected);
    // Trimming every position leaves an empty axis.
    let out = kernels
        .arrange(&a, 1, None, &[0], Along::left(2, 4))
        .expect("all trimmed");
    assert_eq!(read::<f32>(&out), (vec![1, 1, 0, 2], vec![]));
    // Both empty.
    let out = kernels
        .arrange(&none, 0, Some((&none, 0)), &[], Along::left(2, 0))
        .expect("nothing");
    assert_eq!(read::<f32>(&out), (vec![0, 1, 4, 2], vec![]));
}

#[test]
fn kernels_can_move_to_a_pool_worker_thread() {
    fn sendable<T: Send>() {}
    sendable::<Kernels>();
}

#[test]
fn concat_joins_along_an_axis() {
    let mut kernels = kernels();
    let mask = value(&[2, 3], vec![0i64, 1, 1, 1, 1, 1]);
    let column = value(&[2, 1], vec![1i64, 1]);
    let out = kernels.concat(&mask, &column, 1).expect("concatenates");
    assert_eq!(read::<i64>(&out), (vec![2, 4], vec![0, 1, 1, 1, 1, 1, 1, 1]));
    let past = value(&[1, 2, 2, 1], vec![1.0f32, 2.0, 3.0, 4.0]);
    let new = value(&[1, 2, 1, 1], vec![5.0f32, 6.0]);
    let out = kernels.concat(&past, &new, 2).expect("concatenates");
    assert_eq!(
        read::<f32>(&out),
        (vec![1, 2, 3, 1], vec![1.0, 2.0, 5.0, 3.0, 4.0, 6.0])
    );
}

#[test]
fn last_position_picks_the_last_logits_as_fp32() {
    let mut kernels = kernels();
    let data = counting(24, 0.0);
    let logits = value(&[2, 3, 4], data.clone());
    let expected: Vec<f32> = [&data[8..12], &data[20..24]].concat();
    assert_eq!(kernels.last_position(&logits).expect("picks"), expected);
    let halves: Vec<f16> = data.iter().map(|&v| f16::from_f32(v * 0.5)).collect();
    let logits = value(&[2, 3, 4], halves);
    let halved: Vec<f32> = expected.iter().map(|v| v * 0.5).collect();
    assert_eq!(kernels.last_position(&logits).expect("picks"), halved);
}

#[test]
fn bad_inputs_are_errors_that_say_what_is_wrong() {
    let mut kernels = kernels();
    let a = value(&[1, 2, 3, 2], counting(12, 0.0));
    let flat = value(&[1, 3], counting(3, 0.0));
    let err = kernels
        .arrange(&a, 0, Some((&flat, 0)), &[0], Along::left(2, 0))
        .unwrap_err();
    assert!(err.contains("rank mismatch"), "{err}");
    let err = kernels.concat(&a, &flat, 1).unwrap_err();
    assert!(err.contains("rank mismatch"), "{err}");
    let err = kernels
        .arrange(&a, 0, Some((&a, 1)), &[0], Along::left(2, 0))
        .unwrap_err();
    assert!(err.contains("padded lengths"), "{err}");
    let err = kernels.arrange(&a, 0, None, &[1], Along::left(2, 0)).unwrap_err();
    assert!(err.contains("row 1 is out of range"), "{err}");
    let err = kernels.arrange(&a, 0, None, &[0], Along::left(4, 0)).unwrap_err();
    assert!(err.contains("axis 4"), "{err}");
    let err = kernels.arrange(&a, 0, None, &[0], Along::left(2, 4)).unwrap_err();
    assert!(err.contains("positions 4.."), "{err}");
    let err = kernels.arrange(&a, 0, None, &[0], Along::right(2, -1)).unwrap_err();
    assert!(err.contains("positions 0..-1"), "{err}");
    let ints = value(&[1, 2, 3, 2], vec![0i64; 12]);
    let err = kernels
        .arrange(&a, 0, Some((&ints, 0)), &[0], Along::left(2, 0))
        .unwrap_err();
    assert!(err.contains("element type"), "{err}");
    let err = kernels.last_position(&a).unwrap_err();
    assert!(err.contains("rank 4"), "{err}");
    let err = kernels.last_position(&value(&[1, 2, 2], vec![0i64; 4])).unwrap_err();
    assert!(err.contains("FP32 or FP16"), "{err}");
    assert!(kernels.device().is_cpu_accessible());
}
