//! Any bytes, as a payload and cut into a three-frame ZMQ message: the decoder must
//! return (an error or a batch), never panic, loop, or blow the stack.
#![no_main]

use kvscope_agent::kv_events::{decode_payload, split_frames};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = decode_payload(data);
    if data.len() >= 2 {
        // The first two bytes choose where the frames are cut.
        let rest = &data[2..];
        let a = usize::from(data[0]) % (rest.len() + 1);
        let b = a + usize::from(data[1]) % (rest.len() - a + 1);
        let frames = [&rest[..a], &rest[a..b], &rest[b..]];
        if let Ok((_seq, payload)) = split_frames(&frames) {
            let _ = decode_payload(payload);
        }
    }
});
