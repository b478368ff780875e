//! Cutting tool output for the model without splitting a UTF-8 character.
//!
//! Byte limits cut output anywhere; a character cut in two would show as U+FFFD, so the partial
//! bytes at a cut are dropped instead.

/// Length of `bytes` without a UTF-8 sequence cut off at its end.
pub fn complete_prefix_len(bytes: &[u8]) -> usize {
    match std::str::from_utf8(bytes) {
        // `error_len() == None` means the input ended in the middle of a character.
        Err(err) if err.error_len().is_none() => err.valid_up_to(),
        _ => bytes.len(),
    }
}

/// Where `bytes` starts once the rest of a character cut off before it is skipped (at most the
/// three continuation bytes a UTF-8 sequence can have).
pub fn complete_suffix_start(bytes: &[u8]) -> usize {
    bytes
        .iter()
        .take(3)
        .take_while(|byte| is_continuation(**byte))
        .count()
}

fn is_continuation(byte: u8) -> bool {
    byte & 0b1100_0000 == 0b1000_0000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_characters_at_either_cut_are_left_out() {
        let text = "aé€".as_bytes();
        assert_eq!(complete_prefix_len(text), text.len());
        assert_eq!(complete_prefix_len(&text[..text.len() - 1]), 3);
        assert_eq!(complete_suffix_start(text), 0);
        assert_eq!(complete_suffix_start(&text[2..]), 1);
        assert_eq!(complete_suffix_start(&text[4..]), 2);
    }
}
