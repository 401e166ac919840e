//! A method's instructions, decoded one at a time as its paths reach them (its cold
//! part, outside the symbol, included), and shown as the evidence prints them.

use std::collections::HashMap;

use iced_x86::{Decoder, DecoderOptions, Formatter, GasFormatter, Instruction};

use super::MethodCode;

pub(super) struct Listing<'a, 'c> {
    /// The method's name in the evidence.
    name: &'static str,
    method: MethodCode<'a>,
    /// The code at an address outside the method (a jump's target).
    code_at: &'c dyn Fn(u64) -> Option<MethodCode<'a>>,
    decoded: HashMap<u64, Option<Instruction>>,
}

impl<'a, 'c> Listing<'a, 'c> {
    pub(super) fn new(
        name: &'static str,
        method: MethodCode<'a>,
        code_at: &'c dyn Fn(u64) -> Option<MethodCode<'a>>,
    ) -> Self {
        Listing {
            name,
            method,
            code_at,
            decoded: HashMap::new(),
        }
    }

    pub(super) fn name(&self) -> &'static str {
        self.name
    }

    /// The method's first instruction's address.
    pub(super) fn entry(&self) -> u64 {
        self.method.address
    }

    /// The instruction at `ip`; None where the bytes there are not one.
    pub(super) fn decode(&mut self, ip: u64) -> Option<Instruction> {
        if let Some(ins) = self.decoded.get(&ip) {
            return *ins;
        }
        let code = match self.offset_in_method(ip) {
            Some(from) => Some(MethodCode {
                address: ip,
                bytes: &self.method.bytes[from as usize..],
            }),
            None => (self.code_at)(ip),
        };
        let ins = code.and_then(|c| {
            let mut d = Decoder::with_ip(64, c.bytes, c.address, DecoderOptions::NONE);
            let ins = d.decode();
            (!ins.is_invalid()).then_some(ins)
        });
        self.decoded.insert(ip, ins);
        ins
    }

    /// How far into the method's symbol `ip` is, when it is inside it.
    fn offset_in_method(&self, ip: u64) -> Option<u64> {
        let end = self.method.address + self.method.bytes.len() as u64;
        (self.method.address..end)
            .contains(&ip)
            .then(|| ip - self.method.address)
    }

    /// `method+0xNN: instruction` (the address alone outside the symbol), for an
    /// instruction decoded before.
    pub(super) fn text(&self, ip: u64) -> String {
        let Some(Some(ins)) = self.decoded.get(&ip) else {
            return format!("{ip:#x}");
        };
        let mut f = GasFormatter::new();
        f.options_mut().set_uppercase_hex(false);
        let mut text = String::new();
        f.format(ins, &mut text);
        match self.offset_in_method(ip) {
            Some(off) => format!("{}+{off:#x}: {text}", self.name),
            None => format!("{ip:#x}: {text}"),
        }
    }
}
