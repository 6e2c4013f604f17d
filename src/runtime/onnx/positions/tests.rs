//! The rewrite on hand-written graphs: the rotary path of a slot-rotating decoder gets
//! `position_ids`, its mask keeps the slots, and other graphs are left alone.

use super::super::proto::{self, Dim, Graph};
use super::{Node, fields, with_position_ids};

/// A decoder's position logic as Optimum's Gemma has it: `Unsqueeze(Range)` feeding both a
/// causal mask (`LessOrEqual`) and a rotation (`Cos`), plus `position_ids` when `given`.
fn decoder(given: bool) -> Vec<u8> {
    let info = |name: &str| proto::value_info(name, proto::INT64, &[Dim::Symbolic("n")]);
    let mut graph = Graph::default();
    graph
        .input(info("start"))
        .input(info("past_key_values.0.key"))
        .node(proto::node(&["start", "start", "start"], "slots", "Range", &[]))
        .node(proto::node(&["slots", "start"], "positions", "Unsqueeze", &[]))
        .node(proto::node(&["positions", "start"], "mask", "LessOrEqual", &[]))
        .node(proto::node(&["positions"], "angles", "Cast", &[]))
        .node(proto::node(&["angles"], "cos", "Cos", &[]))
        .output(info("mask"))
        .output(info("cos"));
    if given {
        graph.input(info("position_ids"));
    }
    proto::model(&graph.to_message("g"), 8, 18)
}

/// The nodes and input names of a written model.
fn read(model: &[u8]) -> (Vec<(String, Vec<String>)>, Vec<String>) {
    let top = fields(model).unwrap();
    let graph = fields(top.iter().find(|f| f.number == 7).unwrap().bytes().unwrap()).unwrap();
    let nodes = graph
        .iter()
        .filter(|f| f.number == 1)
        .map(|f| {
            let node = Node::read(f.bytes().unwrap()).unwrap();
            (node.op.to_string(), node.inputs.iter().map(|s| s.to_string()).collect())
        })
        .collect();
    let inputs = graph
        .iter()
        .filter(|f| f.number == 11)
        .map(|f| super::string_field(f.bytes().unwrap(), 1).unwrap().to_string())
        .collect();
    (nodes, inputs)
}

#[test]
fn a_slot_rotating_decoder_gets_position_ids_for_its_rotation_only() {
    let (nodes, inputs) = read(&with_position_ids(&decoder(false)).expect("rewritten"));
    assert_eq!(inputs.last().map(String::as_str), Some("position_ids"));
    let inputs_of = |op: &str| nodes.iter().find(|(o, _)| o == op).unwrap().1.clone();
    assert_eq!(
        inputs_of("Cast"),
        ["position_ids"],
        "the rotation takes the rows' positions"
    );
    assert_eq!(
        inputs_of("LessOrEqual"),
        ["positions", "start"],
        "the mask keeps the slots"
    );
    assert_eq!(nodes.len(), 5);
}

#[test]
fn graphs_that_take_positions_or_are_not_decoders_are_left_alone() {
    assert_eq!(with_position_ids(&decoder(true)), None);
    let mut graph = Graph::default();
    graph
        .input(proto::value_info("x", proto::FLOAT, &[Dim::Fixed(1)]))
        .node(proto::node(&["x"], "y", "Cos", &[]))
        .output(proto::value_info("y", proto::FLOAT, &[Dim::Fixed(1)]));
    assert_eq!(with_position_ids(&proto::model(&graph.to_message("g"), 8, 18)), None);
    assert_eq!(with_position_ids(b"\xff\xff not a model"), None);
}
