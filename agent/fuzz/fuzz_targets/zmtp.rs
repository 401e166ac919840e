//! Any bytes as what a ZMQ peer sends after the greeting, fed in pieces of varying size:
//! the frame decoder must return items or an error, never panic, and never hold more
//! than its limits allow whatever sizes the bytes claim.
#![no_main]

use bytes::BytesMut;
use kvscope_agent::taps::engine::zmtp::{
    parse_command, parse_greeting, FrameDecoder, Item, Limits,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() >= 64 {
        let _ = parse_greeting(data[..64].try_into().unwrap());
    }
    let Some((&step, rest)) = data.split_first() else {
        return;
    };
    let limits = Limits {
        max_message_bytes: 4096,
        max_frames: 8,
    };
    let mut d = FrameDecoder::new(limits);
    let mut buf = BytesMut::new();
    for chunk in rest.chunks(usize::from(step).max(1)) {
        buf.extend_from_slice(chunk);
        loop {
            match d.decode(&mut buf) {
                Ok(Some(Item::Message(frames))) => {
                    assert!(frames.len() <= limits.max_frames);
                    assert!(
                        frames.iter().map(|f| f.len() as u64).sum::<u64>()
                            <= limits.max_message_bytes
                    );
                }
                Ok(Some(Item::Command(body))) => {
                    let _ = parse_command(&body);
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
});
