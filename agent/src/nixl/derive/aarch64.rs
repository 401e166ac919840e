//! The aarch64 front end of the offsets' derivation: a method of an aarch64 build
//! (Grace nodes run NIXL too), decoded with `yaxpeax-arm`, run into the same steps the
//! x86-64 walker gives, so the fields are found by the same patterns and one struct
//! layout can be checked across both builds of a version.
//!
//! AAPCS64: arguments in `x0`–`x5` (`this` first), the answer in `w0`/`x0`, `x19`–`x28`
//! kept across calls, `x29` the frame, `sp` never a general register. GCC keeps `this`
//! and the request in callee-saved registers it reuses in cold blocks (a log message's
//! builder), so a register's value at an instruction is what every path reaching it
//! forward agrees on: one pass in address order, each instruction's state the meet of
//! the states its forward predecessors hand it (a loop is seen on its first iteration,
//! as the x86-64 pass sees it).

use std::collections::{BTreeMap, HashMap};

use yaxpeax_arch::{Decoder, U8Reader};
use yaxpeax_arm::armv8::a64::{InstDecoder, Instruction, Opcode, Operand, SIMDSizeCode, SizeCode};

use super::{Loc, MethodCode, Run, Seen, Step, Sym, Value};

/// `sp` and the zero register share number 31; which one an operand means is in its kind.
const SP: u16 = 31;
const ZR: u16 = 31;
const FP: usize = 29;

/// A register's symbolic value and the step that set it (`usize::MAX`: the entry).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Held {
    sym: Sym,
    origin: usize,
}

/// A register loaded from `*(argument 1 + list_at) + disp` through pointer register
/// `pointer`: a descriptor's field, summed in `registerMem`'s loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Loaded {
    list_at: i64,
    disp: i64,
    pointer: usize,
    origin: usize,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct State {
    x: [Option<Held>; 32],
    /// The SIMD registers, as 16-byte copies.
    v: [Option<Held>; 32],
    imm: [Option<u64>; 32],
    loaded: [Option<Loaded>; 32],
    /// `sp`, relative to its value at entry.
    sp: Option<i64>,
    /// `x29`, the frame, relative to `sp` at entry.
    fp: Option<i64>,
    /// Stack slots by their offset from `sp` at entry.
    slots: BTreeMap<i64, Held>,
}

impl State {
    fn entry() -> State {
        let mut s = State {
            sp: Some(0),
            ..State::default()
        };
        for arg in 0..6u8 {
            s.x[usize::from(arg)] = Some(Held {
                sym: Sym::Addr { arg, off: 0 },
                origin: usize::MAX,
            });
        }
        s
    }

    /// What both states agree on.
    fn meet(&mut self, other: &State) {
        fn keep<T: PartialEq + Copy>(a: &mut [Option<T>; 32], b: &[Option<T>; 32]) {
            for (x, y) in a.iter_mut().zip(b) {
                if *x != *y {
                    *x = None;
                }
            }
        }
        keep(&mut self.x, &other.x);
        keep(&mut self.v, &other.v);
        keep(&mut self.imm, &other.imm);
        keep(&mut self.loaded, &other.loaded);
        if self.sp != other.sp {
            self.sp = None;
        }
        if self.fp != other.fp {
            self.fp = None;
        }
        self.slots.retain(|k, v| other.slots.get(k) == Some(v));
    }

    /// General register `r` no longer holds anything tracked.
    fn forget(&mut self, r: usize) {
        if r < 32 {
            self.x[r] = None;
            self.imm[r] = None;
            self.loaded[r] = None;
        }
        if r == FP {
            self.fp = None;
        }
    }
}

/// `code` run into steps.
pub(super) fn run(name: &str, code: MethodCode<'_>) -> Run {
    let decoder = InstDecoder::default();
    let mut decoded: Vec<(u64, Instruction)> = Vec::new();
    for (i, word) in code.bytes.chunks_exact(4).enumerate() {
        let mut reader = U8Reader::new(word);
        let mut ins = Instruction::default();
        if decoder.decode_into(&mut ins, &mut reader).is_err() {
            break;
        }
        decoded.push((code.address.wrapping_add(4 * i as u64), ins));
    }
    let index_of: HashMap<u64, usize> = decoded
        .iter()
        .enumerate()
        .map(|(i, (ip, _))| (*ip, i))
        .collect();
    let mut incoming: HashMap<usize, State> = HashMap::new();
    incoming.insert(0, State::entry());
    let mut steps = Vec::with_capacity(decoded.len());
    let mut sums: Vec<(usize, Seen)> = Vec::new();
    for (i, (ip, ins)) in decoded.iter().enumerate() {
        // Reached by no forward path (a landing pad, a loop's body entered from its
        // test below): nothing is known there, and it hands nothing on (the paths that
        // do reach what follows decide what is known there).
        let (mut state, reached) = match incoming.remove(&i) {
            Some(s) => (s, true),
            None => (State::default(), false),
        };
        let target = branch_target(ins).map(|by| ip.wrapping_add(by as u64));
        let store = store_of(&state, ins);
        let mut arg_origins = [None; 6];
        let seen = step(&mut state, ins, i, &mut arg_origins, &mut sums);
        let cond_target = target.filter(|_| is_conditional(ins.opcode));
        steps.push(Step {
            ip: *ip,
            evidence: format!("{name}+{:#x}: {ins}", ip.wrapping_sub(code.address)),
            store,
            cond_target,
            seen,
            arg_origins,
            // Read only where the refusal site is placed, on x86-64 builds.
            first_args_held: false,
        });
        if !reached {
            continue;
        }
        let mut hand = |to: usize, state: &State| match incoming.get_mut(&to) {
            Some(s) => s.meet(state),
            None => {
                incoming.insert(to, state.clone());
            }
        };
        if let Some(to) = target.and_then(|t| index_of.get(&t)).copied() {
            if to > i {
                hand(to, &state);
            }
        }
        if !matches!(ins.opcode, Opcode::B | Opcode::BR | Opcode::RET) {
            hand(i + 1, &state);
        }
    }
    // A descriptor's field summed is seen where it was loaded (`ldr t,[p,#len]`), as the
    // x86-64 `add len(p),acc` shows both at once.
    for (at, sum) in sums {
        if let Some(s) = steps.get_mut(at) {
            s.seen.push(sum);
        }
    }
    Run { steps }
}

/// A store's displacement and size (both registers of a pair), through a register
/// other than `sp` or the frame.
fn store_of(state: &State, ins: &Instruction) -> Option<(i64, usize)> {
    let pair = match ins.opcode {
        Opcode::STR
        | Opcode::STUR
        | Opcode::STRB
        | Opcode::STURB
        | Opcode::STRH
        | Opcode::STURH => false,
        Opcode::STP => true,
        _ => return None,
    };
    let regs = if pair { 2 } else { 1 };
    let size = access_size(ins.opcode, &ins.operands[0])?;
    let disp = match ins.operands[regs] {
        Operand::RegPreIndex(base, disp, _) if !is_stack(state, base) => i64::from(disp),
        Operand::RegPostIndex(base, _) if !is_stack(state, base) => 0,
        _ => return None,
    };
    Some((disp, size * regs))
}

fn is_stack(state: &State, base: u16) -> bool {
    base == SP || (usize::from(base) == FP && state.fp.is_some())
}

fn is_conditional(op: Opcode) -> bool {
    matches!(
        op,
        Opcode::Bcc(_) | Opcode::CBZ | Opcode::CBNZ | Opcode::TBZ | Opcode::TBNZ
    )
}

/// A direct branch's offset from its instruction (a call's target is another function,
/// not a successor).
fn branch_target(ins: &Instruction) -> Option<i64> {
    match ins.opcode {
        Opcode::B | Opcode::Bcc(_) | Opcode::CBZ | Opcode::CBNZ | Opcode::TBZ | Opcode::TBNZ => {
            ins.operands.iter().find_map(|o| match o {
                Operand::PCOffset(by) => Some(*by),
                _ => None,
            })
        }
        _ => None,
    }
}

/// The bytes a load or store moves per register.
fn access_size(op: Opcode, reg: &Operand) -> Option<usize> {
    match op {
        Opcode::LDRB | Opcode::STRB | Opcode::LDURB | Opcode::STURB => return Some(1),
        Opcode::LDRH | Opcode::STRH | Opcode::LDURH | Opcode::STURH => return Some(2),
        Opcode::LDRSW | Opcode::LDURSW | Opcode::LDPSW => return Some(4),
        _ => {}
    }
    match reg {
        Operand::Register(SizeCode::X, _) => Some(8),
        Operand::Register(SizeCode::W, _) => Some(4),
        Operand::SIMDRegister(size, _) => Some(match size {
            SIMDSizeCode::B => 1,
            SIMDSizeCode::H => 2,
            SIMDSizeCode::S => 4,
            SIMDSizeCode::D => 8,
            SIMDSizeCode::Q => 16,
        }),
        _ => None,
    }
}

/// A general register operand's number and whether it is 64-bit; `sp_ok` when the
/// operand kind means `sp` for 31.
fn gpr(o: &Operand) -> Option<(usize, bool, bool)> {
    match o {
        Operand::Register(size, r) => Some((usize::from(*r), *size == SizeCode::X, false)),
        Operand::RegisterOrSP(size, r) => Some((usize::from(*r), *size == SizeCode::X, true)),
        _ => None,
    }
}

/// Where `base + disp` points.
fn location(state: &State, base: u16, disp: i64) -> (Loc, Option<i64>) {
    if base == SP {
        return (Loc::Other, state.sp.map(|sp| sp.wrapping_add(disp)));
    }
    if usize::from(base) == FP {
        if let Some(fp) = state.fp {
            return (Loc::Other, Some(fp.wrapping_add(disp)));
        }
    }
    match state.x[usize::from(base)].map(|h| h.sym) {
        Some(Sym::Addr { arg, off }) => (
            Loc::Field {
                arg,
                off: off.wrapping_add(disp),
            },
            None,
        ),
        Some(Sym::Read { arg, off }) => (Loc::Deref { arg, off, disp }, None),
        None => (Loc::Other, None),
    }
}

/// The base register's value moved by `by` (a pre- or post-indexed access's writeback).
fn advance_base(state: &mut State, base: u16, by: i64) {
    if base == SP {
        state.sp = state.sp.map(|sp| sp.wrapping_add(by));
        return;
    }
    let r = usize::from(base);
    let moved = state.x[r].and_then(|h| match h.sym {
        Sym::Addr { arg, off } => Some(Held {
            sym: Sym::Addr {
                arg,
                off: off.wrapping_add(by),
            },
            origin: h.origin,
        }),
        Sym::Read { .. } => None,
    });
    let fp = state.fp.filter(|_| r == FP).map(|fp| fp.wrapping_add(by));
    state.forget(r);
    state.x[r] = moved;
    state.fp = fp;
}

fn step(
    state: &mut State,
    ins: &Instruction,
    index: usize,
    arg_origins: &mut [Option<usize>; 6],
    sums: &mut Vec<(usize, Seen)>,
) -> Vec<Seen> {
    let mut seen = Vec::new();
    let op = ins.opcode;
    let ops = &ins.operands;
    match op {
        Opcode::BL | Opcode::BLR => {
            let mut args = [None; 6];
            for (i, a) in args.iter_mut().enumerate() {
                *a = state.x[i].map(|h| h.sym);
                arg_origins[i] = state.x[i].map(|h| h.origin).filter(|o| *o != usize::MAX);
            }
            seen.push(Seen::Call {
                indirect: op == Opcode::BLR,
                args,
            });
            // x0–x18 and x30 are the callee's; so are the SIMD registers' upper halves.
            for r in (0..=18).chain([30]) {
                state.forget(r);
            }
            state.v = [None; 32];
        }
        Opcode::LDR
        | Opcode::LDUR
        | Opcode::LDRB
        | Opcode::LDURB
        | Opcode::LDRH
        | Opcode::LDURH
        | Opcode::LDRSW
        | Opcode::LDURSW
        | Opcode::LDP
        | Opcode::LDPSW
        | Opcode::STR
        | Opcode::STUR
        | Opcode::STRB
        | Opcode::STURB
        | Opcode::STRH
        | Opcode::STURH
        | Opcode::STP => {
            let pair = matches!(op, Opcode::LDP | Opcode::LDPSW | Opcode::STP);
            let regs = if pair { &ops[..2] } else { &ops[..1] };
            let mem = ops[regs.len()];
            let load = !matches!(
                op,
                Opcode::STR
                    | Opcode::STUR
                    | Opcode::STRB
                    | Opcode::STURB
                    | Opcode::STRH
                    | Opcode::STURH
                    | Opcode::STP
            );
            let (base, disp, writeback) = match mem {
                Operand::RegPreIndex(base, disp, wb) => {
                    (Some(base), i64::from(disp), wb.then_some(i64::from(disp)))
                }
                Operand::RegPostIndex(base, by) => (Some(base), 0, Some(i64::from(by))),
                _ => (None, 0, None),
            };
            let mut at = disp;
            for reg in regs {
                let Some(size) = access_size(op, reg) else {
                    continue;
                };
                let (loc, slot) = base.map_or((Loc::Other, None), |b| location(state, b, at));
                if load {
                    seen.push(Seen::Read { at: loc, size });
                    load_into(state, reg, size, loc, slot, base, index);
                } else {
                    let value = stored(state, reg, size);
                    if let Some(key) = slot {
                        match (value, register_held(state, reg)) {
                            (Value::Sym(_), Some(h)) if size >= 8 => {
                                state.slots.insert(key, h);
                            }
                            _ => {
                                state.slots.remove(&key);
                            }
                        }
                    }
                    seen.push(Seen::Write {
                        at: loc,
                        size,
                        value,
                    });
                }
                at = at.wrapping_add(size as i64);
            }
            if let (Some(base), Some(by)) = (base, writeback) {
                advance_base(state, base, by);
            }
            if base.is_none() {
                // A literal or register-offset access: what it loads is not tracked.
                for reg in regs.iter().filter(|_| load) {
                    forget_operand(state, reg);
                }
            }
        }
        Opcode::ORR
            if matches!(ops[1], Operand::Register(_, ZR))
                && matches!(ops[2], Operand::RegShift(_, 0, _, _)) =>
        {
            // `mov d, m`.
            if let (Some((d, wide, _)), Operand::RegShift(_, _, _, m)) = (gpr(&ops[0]), ops[2]) {
                let m = usize::from(m);
                let (held, imm, loaded) = if m == usize::from(ZR) {
                    (None, Some(0), None)
                } else {
                    (
                        state.x[m].filter(|_| wide),
                        state.imm[m].map(|v| if wide { v } else { v & 0xffff_ffff }),
                        state.loaded[m].filter(|_| wide),
                    )
                };
                state.forget(d);
                state.x[d] = held.map(|h| Held { origin: index, ..h });
                state.imm[d] = imm;
                state.loaded[d] = loaded;
            }
        }
        Opcode::ADD | Opcode::SUB => add_or_sub(state, ins, index, &mut seen, sums),
        Opcode::MOVZ | Opcode::MOVN => {
            if let (Some((d, wide, _)), Operand::ImmShift(v, sh)) = (gpr(&ops[0]), ops[1]) {
                let v = u64::from(v).checked_shl(u32::from(sh)).unwrap_or(0);
                let v = if op == Opcode::MOVN { !v } else { v };
                state.forget(d);
                state.imm[d] = Some(if wide { v } else { v & 0xffff_ffff });
            }
        }
        Opcode::B | Opcode::BR | Opcode::RET => {}
        _ if is_conditional(op) => {}
        // Compares and the like write only the flags (their first operand is read).
        Opcode::CCMP | Opcode::CCMN | Opcode::PRFM | Opcode::PRFUM | Opcode::MSR => {}
        _ => {
            // Anything else writes its first operand, which is no longer tracked.
            if let Some((d, _, sp_ok)) = gpr(&ops[0]) {
                if sp_ok && d == usize::from(SP) {
                    state.sp = None;
                } else if d != usize::from(ZR) {
                    state.forget(d);
                }
            }
            if let Operand::SIMDRegister(_, v) = ops[0] {
                state.v[usize::from(v)] = None;
            }
        }
    }
    seen
}

/// The value a store writes from `reg`.
fn stored(state: &State, reg: &Operand, size: usize) -> Value {
    match reg {
        Operand::Register(_, ZR) => Value::Imm(0),
        Operand::Register(_, r) => {
            let r = usize::from(*r);
            match (state.x[r], state.imm[r]) {
                (Some(h), _) if size == 8 => Value::Sym(h.sym),
                (_, Some(v)) => Value::Imm(match size {
                    1 => v & 0xff,
                    2 => v & 0xffff,
                    4 => v & 0xffff_ffff,
                    _ => v,
                }),
                _ => Value::Untracked {
                    returned: r == 0 && size == 4,
                },
            }
        }
        Operand::SIMDRegister(_, v) => match state.v[usize::from(*v)] {
            Some(h) if size == 16 => Value::Sym(h.sym),
            _ => Value::Unknown,
        },
        _ => Value::Unknown,
    }
}

fn register_held(state: &State, reg: &Operand) -> Option<Held> {
    match reg {
        Operand::Register(SizeCode::X, r) if *r != ZR => state.x[usize::from(*r)],
        Operand::SIMDRegister(SIMDSizeCode::Q, v) => state.v[usize::from(*v)],
        _ => None,
    }
}

fn forget_operand(state: &mut State, reg: &Operand) {
    match reg {
        Operand::Register(_, r) if *r != ZR => state.forget(usize::from(*r)),
        Operand::SIMDRegister(_, v) => state.v[usize::from(*v)] = None,
        _ => {}
    }
}

/// `reg` loaded with `size` bytes from `loc` (a stack slot when `slot`).
fn load_into(
    state: &mut State,
    reg: &Operand,
    size: usize,
    loc: Loc,
    slot: Option<i64>,
    base: Option<u16>,
    index: usize,
) {
    let sym = match slot {
        Some(key) => state.slots.get(&key).map(|h| h.sym),
        None => match loc {
            Loc::Field { arg, off } if size == 8 || size == 16 => Some(Sym::Read { arg, off }),
            _ => None,
        },
    };
    let held = sym.map(|sym| Held { sym, origin: index });
    match reg {
        Operand::Register(_, r) if *r != ZR => {
            let r = usize::from(*r);
            state.forget(r);
            state.x[r] = held.filter(|_| size == 8);
            if let (Loc::Deref { arg: 1, off, disp }, Some(b), 8) = (loc, base, size) {
                state.loaded[r] = Some(Loaded {
                    list_at: off,
                    disp,
                    pointer: usize::from(b),
                    origin: index,
                });
            }
        }
        Operand::SIMDRegister(_, v) => state.v[usize::from(*v)] = held.filter(|_| size == 16),
        _ => {}
    }
}

fn add_or_sub(
    state: &mut State,
    ins: &Instruction,
    index: usize,
    seen: &mut Vec<Seen>,
    sums: &mut Vec<(usize, Seen)>,
) {
    let ops = &ins.operands;
    let (Some((d, wide, d_sp)), Some((n, _, n_sp))) = (gpr(&ops[0]), gpr(&ops[1])) else {
        if let Some((d, ..)) = gpr(&ops[0]) {
            state.forget(d);
        }
        return;
    };
    let imm = match ops[2] {
        Operand::Immediate(v) => Some(i64::from(v)),
        Operand::ImmShift(v, sh) => i64::from(v).checked_shl(u32::from(sh)),
        _ => None,
    };
    let d_is_sp = d_sp && d == usize::from(SP);
    let n_is_sp = n_sp && n == usize::from(SP);
    let Some(by) = imm.map(|v| {
        if ins.opcode == Opcode::SUB {
            v.wrapping_neg()
        } else {
            v
        }
    }) else {
        // `add acc, acc, t` with `t` a descriptor's field: the sum of `registerMem`.
        if ins.opcode == Opcode::ADD && wide && !d_is_sp {
            let summed = [&ops[1], &ops[2]].into_iter().find_map(|o| match o {
                Operand::Register(SizeCode::X, r) | Operand::RegShift(_, 0, SizeCode::X, r)
                    if *r != ZR =>
                {
                    state.loaded[usize::from(*r)]
                }
                _ => None,
            });
            if let Some(l) = summed {
                sums.push((
                    l.origin,
                    Seen::Sum {
                        list_at: l.list_at,
                        len_at: l.disp,
                        pointer: l.pointer,
                    },
                ));
            }
        }
        if d_is_sp {
            state.sp = None;
        } else {
            state.forget(d);
        }
        return;
    };
    if d_is_sp {
        state.sp = if n_is_sp {
            state.sp.map(|sp| sp.wrapping_add(by))
        } else if n == FP {
            state.fp.map(|fp| fp.wrapping_add(by))
        } else {
            None
        };
        return;
    }
    if n_is_sp {
        let fp = state.sp.map(|sp| sp.wrapping_add(by)).filter(|_| d == FP);
        state.forget(d);
        state.fp = fp;
        return;
    }
    if d == n && wide {
        seen.push(Seen::Advance { reg: d, by });
    }
    let held = state.x[n].filter(|_| wide).and_then(|h| match h.sym {
        Sym::Addr { arg, off } => Some(Held {
            sym: Sym::Addr {
                arg,
                off: off.wrapping_add(by),
            },
            origin: index,
        }),
        Sym::Read { .. } => None,
    });
    let fp = state
        .fp
        .filter(|_| d == FP && n == FP)
        .map(|fp| fp.wrapping_add(by));
    state.forget(d);
    state.x[d] = held;
    state.fp = fp;
}

#[cfg(test)]
mod tests {
    use super::super::{descriptor_sum, telemetry};
    use super::*;

    fn code(words: &[u32]) -> Vec<u8> {
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    fn run_of(words: &[u32]) -> Run {
        let bytes = code(words);
        run(
            "m",
            MethodCode {
                address: 0x1000,
                bytes: &bytes,
            },
        )
    }

    fn reads(run: &Run, ip: u64) -> Vec<Loc> {
        let step = run.steps.iter().find(|s| s.ip == ip).unwrap();
        step.seen
            .iter()
            .filter_map(|s| match s {
                Seen::Read { at, .. } => Some(*at),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn the_telemetry_copy_of_a_real_build_gives_its_fields() {
        // getXferTelemetry of the nixl-cu12 1.5.1 aarch64 wheel: the block copied with
        // a pair of q registers, the descriptor count with an x register.
        let run = run_of(&[
            0xa9bd7bfd, // stp x29, x30, [sp, #-48]!
            0x910003fd, // mov x29, sp
            0xa90153f3, // stp x19, x20, [sp, #16]
            0xf9400000, // ldr x0, [x0]
            0xf9419000, // ldr x0, [x0, #800]
            0xb4000160, // cbz x0, +0x2c (outside)
            0xb940b820, // ldr w0, [x1, #184]
            0xaa0103f3, // mov x19, x1
            0x35000480, // cbnz w0, +0x90 (outside)
            0xad46783f, // ldp q31, q30, [x1, #192]
            0xf9407021, // ldr x1, [x1, #224]
            0xf9001041, // str x1, [x2, #32]
            0xad00785f, // stp q31, q30, [x2]
            0xa94153f3, // ldp x19, x20, [sp, #16]
            0xa8c37bfd, // ldp x29, x30, [sp], #48
            0xd65f03c0, // ret
        ]);
        let t = telemetry(&run).unwrap();
        assert_eq!(t.status.unwrap().value, 0xb8);
        let bytes = t.bytes.unwrap();
        assert_eq!(bytes.value, 0xd8);
        assert_eq!(
            bytes.evidence,
            [
                "m+0x24: ldp q31, q30, [x1, #0xc0]",
                "m+0x30: stp q31, q30, [x2]"
            ]
        );
        assert_eq!(t.descs.unwrap().value, 0xe0);
        // `this`'s first read is the agent's data.
        let (_, off) = run.first_read(|l| l.field_of(0)).unwrap();
        assert_eq!(off, 0);
    }

    #[test]
    fn a_register_holds_what_every_forward_path_agrees_on() {
        let run = run_of(&[
            0xaa0103f3, // 0x1000 mov x19, x1
            0xb4000060, // 0x1004 cbz x0, 0x1010
            0xaa0003f3, // 0x1008 mov x19, x0 (a cold block reuses x19)
            0x14000002, // 0x100c b 0x1014
            0xb940ba60, // 0x1010 ldr w0, [x19, #184]: only the cbz leads here
            0xf9400262, // 0x1014 ldr x2, [x19]: two paths, two values
            0xd65f03c0, // ret
        ]);
        assert_eq!(reads(&run, 0x1010), [Loc::Field { arg: 1, off: 184 }]);
        assert_eq!(reads(&run, 0x1014), [Loc::Other]);
    }

    #[test]
    fn a_block_no_forward_path_reaches_hands_nothing_on() {
        // A rotated loop: its body is entered from its test below.
        let run = run_of(&[
            0xaa0103f3, // 0x1000 mov x19, x1
            0x14000002, // 0x1004 b 0x100c
            0xaa0003f3, // 0x1008 mov x19, x0 (the body)
            0xb940ba60, // 0x100c ldr w0, [x19, #184]
            0x35ffffc0, // 0x1010 cbnz w0, 0x1008
            0xd65f03c0, // ret
        ]);
        assert_eq!(reads(&run, 0x100c), [Loc::Field { arg: 1, off: 184 }]);
    }

    #[test]
    fn registermem_s_loop_gives_the_descriptor_list() {
        // registerMem's sum of the descriptors' lengths (1.5.1 aarch64), the list
        // being argument 1.
        let run = run_of(&[
            0xaa0103fa, // mov x26, x1
            0xa9411342, // ldp x2, x4, [x26, #16]
            0xd2800001, // mov x1, #0
            0xeb02009f, // cmp x4, x2
            0x540000c0, // b.eq (ret)
            0xf9400443, // ldr x3, [x2, #8]
            0x9100e042, // add x2, x2, #0x38
            0x8b030021, // add x1, x1, x3
            0xeb04005f, // cmp x2, x4
            0x54ffff81, // b.ne (the ldr)
            0xd65f03c0, // ret
        ]);
        let (begin, stride, len) = descriptor_sum(&run).unwrap();
        assert_eq!((begin.value, stride.value, len.value), (0x10, 0x38, 0x8));
        assert_eq!(len.evidence, ["m+0x14: ldr x3, [x2, #0x8]"]);
    }

    #[test]
    fn a_method_cut_inside_a_word_ends_at_the_last_whole_one() {
        let bytes = [0xf3, 0x03, 0x01, 0xaa, 0xc0, 0x03];
        let run = run(
            "m",
            MethodCode {
                address: 0x1000,
                bytes: &bytes,
            },
        );
        assert_eq!(run.steps.len(), 1);
        assert_eq!(run.steps[0].evidence, "m+0x0: mov x19, x1");
    }
}
