//! The JSON codec's fast path against serde's: the same documents accepted, the same values read,
//! the same messages for the documents refused.

use proptest::prelude::*;

use super::*;

/// What the fast path and serde make of `json`, as `T`.
fn both<T: Element + Clone>(json: &str) -> (Option<Vec<T>>, Result<Vec<T>, String>) {
    (T::fast(json), through_serde(json))
}

/// `values` as a JSON array, each spelt by `spell`, nested `depth` deep, with `pad` around.
fn document(values: &[f32], spell: impl Fn(f32) -> String, depth: usize, pad: &str) -> String {
    let inner: Vec<String> = values.iter().map(|v| spell(*v)).collect();
    let mut doc = format!("[{pad}{}{pad}]", inner.join(&format!(",{pad}")));
    for _ in 1..depth {
        doc = format!("[{pad}{doc}{pad}]");
    }
    doc
}

proptest! {
    #[test]
    fn every_spelling_of_finite_f32s_reads_back_the_same_values_on_both_paths(
        values in proptest::collection::vec(any::<f32>().prop_filter("finite", |v| v.is_finite()), 0..64),
        spelling in 0..4usize,
        depth in 1..4usize,
        pad in prop_oneof![Just(""), Just(" "), Just("\n\t ")],
    ) {
        let spell = |v: f32| match spelling {
            0 => v.to_string(),
            1 => format!("{:?}", f64::from(v)),
            2 => format!("{v:e}"),
            _ => format!("{:E}", f64::from(v)),
        };
        let json = document(&values, spell, depth, pad);
        let (fast, serde) = both::<f32>(&json);
        let fast = fast.expect("plain numbers take the fast path");
        prop_assert_eq!(&fast, &values);
        prop_assert_eq!(fast, serde.unwrap());
    }

    #[test]
    fn integers_read_the_same_on_both_paths(values in proptest::collection::vec(any::<i64>(), 0..64)) {
        let json = format!("[{}]", values.iter().map(i64::to_string).collect::<Vec<_>>().join(","));
        let (fast, serde) = both::<i64>(&json);
        prop_assert_eq!(fast.as_ref(), Some(&values));
        prop_assert_eq!(fast.unwrap(), serde.unwrap());
    }
}

#[test]
fn what_json_refuses_the_fast_path_leaves_to_serde_and_its_message() {
    for bad in [
        "[1,,2]",
        "[1 2]",
        "[,1]",
        "[1,]",
        "[01]",
        "[+1]",
        "[.5]",
        "[1.]",
        "[1e]",
        "[1e+]",
        "[-]",
        "[1] x",
        "[",
        "]",
        "[[1]",
        "[1]]",
        "",
        "[true]",
        "[null]",
        "[\"1\"]",
        "[NaN]",
        "[Infinity]",
        "[1e39]",
        "{}",
    ] {
        let (fast, serde) = both::<f32>(bad);
        assert_eq!(fast, None, "{bad}: the fast path must not accept it");
        assert!(serde.is_err(), "{bad}: refused");
        assert_eq!(
            TensorData::from_json(DataType::Fp32, bad),
            Err(serde.unwrap_err()),
            "{bad}: the message is serde's"
        );
    }
    // Mixed nesting is accepted by both, as before.
    assert_eq!(both::<f32>("[[1, 2], 3, [[4]]]").0, Some(vec![1.0, 2.0, 3.0, 4.0]));
    assert_eq!(both::<f32>("[]").0, Some(vec![]));
    assert_eq!(both::<f32>("[[], []]").0, Some(vec![]));
}

#[test]
fn integers_outside_the_fast_path_keep_serdes_rules() {
    // A whole number written as a float is an integer; serde decides it.
    assert_eq!(both::<i64>("[3.0, 1e2]").0, None);
    assert_eq!(
        TensorData::from_json(DataType::Int64, "[3.0, 1e2]"),
        Ok(TensorData::Int64(vec![3, 100]))
    );
    assert!(TensorData::from_json(DataType::Int64, "[3.5]").is_err());
    assert_eq!(both::<u8>("[255, 0]").0, Some(vec![255, 0]));
    assert_eq!(both::<u8>("[256]").0, None, "out of range: serde's message");
    assert!(
        TensorData::from_json(DataType::Uint8, "[256]")
            .unwrap_err()
            .contains("not a valid UINT8 element")
    );
    assert_eq!(both::<i64>("[9223372036854775808]").0, None);
    assert_eq!(both::<i64>("[-9223372036854775808]").0, Some(vec![i64::MIN]));
}

#[test]
fn a_number_between_two_f32s_rounds_once_to_the_nearest() {
    // 1 + 2^-24 and a hair (~1e-39) is just above halfway between 1 and the next f32: nearest is
    // 1 + 2^-23. Through f64 it rounds to exactly halfway first, then to even: 1. One rounding is
    // right, and serde's f64-then-cast got it wrong.
    let text = "[1.00000005960464477539062500000000000000086736173798840354720596224069595336914062]";
    assert_eq!(both::<f32>(text).0, Some(vec![1.0 + f32::EPSILON]));
    assert_eq!(both::<f32>(text).1, Ok(vec![1.0]));
}
