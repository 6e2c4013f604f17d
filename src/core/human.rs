//! Text for people: a size as a person writes it, a client's text clipped before it is echoed,
//! an error with its causes, what a caught panic said. Used by every layer that writes a message (the codec's limits,
//! a remote pool's failures, the lifecycle's refusals, the commands' reports).

/// At most `max` characters of a client-given `text`, marked when cut, for echoing it in an
/// error without letting the client choose the size of our answers and logs.
pub fn clipped(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((cut, _)) => format!("{}… ({} bytes)", &text[..cut], text.len()),
        None => text.to_string(),
    }
}

/// A size the way a person reads it: `512 MiB`, `1.5 GiB`, `812 B`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64;
    let mut unit = "B";
    for u in UNITS {
        if value < 1024.0 {
            break;
        }
        value /= 1024.0;
        unit = u;
    }
    if (value - value.round()).abs() < 0.05 {
        format!("{value:.0} {unit}")
    } else {
        format!("{value:.1} {unit}")
    }
}

/// What a panic caught with `catch_unwind` said: its message when it gave one as text (as
/// `panic!` and `expect` do), else `(no message)`.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// An error with its causes, `outer: inner: innermost`: hyper's and reqwest's own messages
/// name only the first, and a cause already in the text is not said twice.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::human_bytes;

    #[test]
    fn sizes_read_like_a_person_writes_them() {
        assert_eq!(human_bytes(812), "812 B");
        assert_eq!(human_bytes(512 << 20), "512 MiB");
        assert_eq!(human_bytes(3 << 29), "1.5 GiB");
        assert_eq!(human_bytes(1024), "1 KiB");
    }
}
