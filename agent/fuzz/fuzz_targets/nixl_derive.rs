//! Any bytes as a libnixl build's methods — each of the methods the derivation reads
//! gets its own slice, and every jump target lands in the input too — through the
//! derivation: never a panic, every field either derived or unknown with its reason.
#![no_main]

use kvscope_agent::nixl::derive::{derive, Isa, MethodCode, METHODS};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first byte picks the instruction set, the next ones cut the rest into one slice per method (a library on a node can
    // hold anything, and methods of any length).
    let Some((&pick, data)) = data.split_first() else {
        return;
    };
    let isa = if pick & 1 == 0 {
        Isa::X86_64
    } else {
        Isa::Aarch64
    };
    let (cuts, code) = data.split_at(data.len().min(METHODS.len()));
    let mut slices = Vec::new();
    let mut rest = code;
    for c in cuts {
        let n = (usize::from(*c) * 8).min(rest.len());
        let (head, tail) = rest.split_at(n);
        slices.push(head);
        rest = tail;
    }
    let base = 0x4_0000u64;
    let method = |prefix: &'static str| {
        let i = METHODS.iter().position(|m| *m == prefix)?;
        let bytes = *slices.get(i)?;
        Some(MethodCode {
            address: base + (i as u64) * 0x1000,
            bytes,
        })
    };
    let at = |address: u64| {
        let from = usize::try_from(address.checked_sub(base)? % 0x1000).ok()?;
        Some(MethodCode {
            address,
            bytes: code.get(from..)?,
        })
    };
    let d = derive(isa, &method, &at, &|_| None);
    let fields = d.fields.len();
    assert!(d.fields.iter().all(|f| f.value.is_some() || f.unknown_because.is_some()));
    let _ = d.offsets();
    assert!(!d.report().is_empty() && fields > 0);
});
