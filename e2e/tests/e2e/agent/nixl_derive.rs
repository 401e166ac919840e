//! The probes' struct offsets derived from a `libnixl.so`'s own instructions: equal to
//! the hand-read table for the lab's build, and bad libraries refused or derived in
//! part with the reason, never a panic. Reads files only (no root, no probes).

use super::support;

use kvscope_agent::nixl::library::NixlLibrary;
use kvscope_agent::nixl::offsets::{self, NixlOffsets};
use std::process::Command;

fn fields(o: &NixlOffsets) -> [(&'static str, u64); 12] {
    [
        ("agent_data", o.agent_data),
        ("data_name", o.data_name),
        ("req_remote", o.req_remote),
        ("req_op", o.req_op),
        ("req_bytes", o.req_bytes),
        ("req_descs", o.req_descs),
        ("req_notif", o.req_notif),
        ("req_has_notif", o.req_has_notif),
        ("dlist_begin", o.dlist_begin),
        ("desc_stride", o.desc_stride),
        ("desc_len", o.desc_len),
        ("req_status", o.req_status),
    ]
}

#[test]
fn the_derived_offsets_are_the_hand_read_table_for_the_lab_build() {
    let libs = support::nixl_libs();
    let lib = NixlLibrary::inspect(&libs.libnixl, true).unwrap();
    let table = offsets::for_build(&lib.build_id).expect("the lab's build is the table's");
    let derived = lib
        .offsets
        .unwrap_or_else(|| panic!("not derived:\n{}", lib.derivation.report()));
    assert_eq!(fields(&derived), fields(&table));
    assert!(lib.sites && lib.post_at_site && lib.creations_at_sites);
    // getXferStatus' sites, derived, are the table's (its hand-read fixture).
    let sites = table.sites.expect("the table has the lab build's sites");
    let derived_ends = lib
        .derivation
        .end_sites
        .as_ref()
        .unwrap_or_else(|why| panic!("{why}\n{}", lib.derivation.report()));
    let status_at = derived_ends.succeeded[0] - sites.status_succeeded.offset as u64;
    let at = |site: offsets::CodeSite| status_at.wrapping_add_signed(site.offset);
    assert_eq!(derived_ends.succeeded, [at(sites.status_succeeded)]);
    assert_eq!(derived_ends.failed, [at(sites.status_failed)]);
    assert_eq!(derived_ends.stale, [at(sites.status_stale)]);
    assert_eq!(
        offsets::SiteValue::Reg(derived_ends.request),
        sites.done_req
    );
    assert_eq!(
        offsets::SiteValue::Const(derived_ends.stale_status),
        sites.stale_status
    );
    assert_eq!(
        offsets::SiteValue::Reg(derived_ends.release_request),
        sites.release_req
    );
    // Each site's place in its method, from the file offsets the probes attach at: the
    // methods' own (their entry probes, without sites) and the sites'.
    let plain = NixlLibrary::inspect(&libs.libnixl, false).unwrap();
    let file_offset = |lib: &NixlLibrary, program: &str| -> Vec<u64> {
        lib.probes
            .iter()
            .filter(|p| p.spec.program == program)
            .map(|p| p.file_offset)
            .collect()
    };
    let into = |program: &str, method_program: &str| -> Vec<i64> {
        let start = file_offset(&plain, method_program)[0] as i64;
        file_offset(&lib, program)
            .iter()
            .map(|at| *at as i64 - start)
            .collect()
    };
    assert_eq!(
        into("xfer_released_in_flight", "release_xfer_enter"),
        [sites.released_in_flight.offset]
    );
    // postXferReq's, derived, is the table's too: the same jump, the status in the
    // same frame slot.
    let post = lib
        .derivation
        .post_site
        .as_ref()
        .unwrap_or_else(|why| panic!("{why}\n{}", lib.derivation.report()));
    assert_eq!(post.status, sites.post_status);
    assert_eq!(
        into("post_xfer_returned", "post_xfer_enter"),
        [sites.post_returned.offset]
    );
    assert!(lib.sites_attached().post_status == Some(sites.post_status));
    // createXferReq's and makeXferReq's failures, derived, are the table's: the same
    // arguments' places, and for createXferReq the same eight paths (one site is the
    // jump into the cold block the table names), statuses and built requests included;
    // makeXferReq's are found per path where the table names the blocks several paths
    // share, with the same statuses.
    let create = lib
        .derivation
        .create_sites
        .as_ref()
        .unwrap_or_else(|why| panic!("{why}\n{}", lib.derivation.report()));
    let make = lib
        .derivation
        .make_sites
        .as_ref()
        .unwrap_or_else(|why| panic!("{why}\n{}", lib.derivation.report()));
    assert_eq!(create.args, sites.create_args);
    assert_eq!(make.args, sites.make_args);
    let create_at = file_offset(&plain, "create_xfer_enter")[0];
    // The probes are attached in the derivation's order: virtual address to file offset.
    let probed: Vec<u64> = lib
        .probes
        .iter()
        .filter(|p| p.spec.program == "xfer_creation_failed")
        .filter(|p| p.cookie.unwrap_or(0) & offsets::FAILED_IN_MAKE == 0)
        .map(|p| p.file_offset)
        .collect();
    assert_eq!(probed.len(), sites.create_failed.len());
    let delta = create.failed[0].at - probed[0];
    for t in sites.create_failed {
        let at = create_at.checked_add_signed(t.site.offset).unwrap() + delta;
        let jump = format!("jmp {at:#018x}");
        let f = create
            .failed
            .iter()
            .find(|f| f.at == at)
            .or_else(|| {
                create.failed.iter().find(|f| {
                    let Some(into) = (f.at - delta).checked_sub(create_at) else {
                        return false;
                    };
                    let text = format!("createXferReq+{into:#x}: {jump}");
                    create.evidence.iter().any(|e| e.ends_with(&text))
                })
            })
            .unwrap_or_else(|| panic!("no site at or jumping to {at:#x}: {create:#?}"));
        assert_eq!(f.cookie(false), t.cookie(false), "{t:?} {f:?}");
    }
    let kinds = |v: &mut Vec<(String, bool)>| {
        v.sort();
        v.dedup();
        v.clone()
    };
    assert_eq!(
        kinds(
            &mut make
                .failed
                .iter()
                .map(|f| (format!("{:?}", f.status), f.request_built))
                .collect()
        ),
        kinds(
            &mut sites
                .make_failed
                .iter()
                .map(|f| (format!("{:?}", f.status), f.request_built))
                .collect()
        )
    );
    let programs: Vec<&str> = lib.probes.iter().map(|p| p.spec.program).collect();
    assert!(!programs.contains(&"create_xfer_enter") && !programs.contains(&"make_xfer_exit"));
    let mut ends = into("xfer_status_changed", "xfer_status_enter");
    ends.sort_unstable();
    assert_eq!(
        ends,
        [sites.status_succeeded.offset, sites.status_failed.offset]
    );
    assert_eq!(
        into("xfer_status_stale", "xfer_status_enter"),
        [sites.status_stale.offset]
    );
    // Placed by the paths, with the instructions that placed them.
    assert!(derived_ends.evidence.len() >= 5, "{derived_ends:?}");
    // The probes are at those three instructions, not on getXferStatus' entry or return.
    let programs: Vec<&str> = lib.probes.iter().map(|p| p.spec.program).collect();
    assert!(!programs.contains(&"xfer_status_enter") && !programs.contains(&"xfer_status_exit"));
    assert!(!programs.contains(&"release_xfer_enter") && !programs.contains(&"post_xfer_exit"));
    assert!(programs.contains(&"xfer_released_in_flight"));
    assert_eq!(
        programs
            .iter()
            .filter(|p| **p == "xfer_status_changed")
            .count(),
        2
    );
    // Every field named by an instruction, most by more than one.
    for f in &lib.derivation.fields {
        assert!(!f.evidence.is_empty(), "{f:?}");
    }
    let confirmed = lib
        .derivation
        .fields
        .iter()
        .filter(|f| f.evidence.len() >= 2)
        .count();
    assert!(confirmed >= 10, "{}", lib.derivation.report());
    assert_eq!(derived.counts, offsets::Counts::Always);
    assert!(
        lib.derivation.telemetry_refused.is_ok(),
        "{}",
        lib.derivation.report()
    );
}

/// The older wheels' builds (scripts/setup): when their requests hold byte counts, and
/// getXferTelemetry's refusal path, read from each; the telemetry flag named by two
/// methods where the build gates counts on it.
#[test]
fn older_builds_say_when_their_counts_are_held_and_where_telemetry_is_refused() {
    use offsets::Counts;
    for (version, counts) in [
        ("1.0.1", Counts::WithTelemetry { data_flag: 0xd0 }),
        ("1.3.2", Counts::WithTelemetry { data_flag: 0xd8 }),
        ("1.4.1", Counts::Always),
    ] {
        let lib = NixlLibrary::inspect(
            &support::older_nixl_lib_dir(version).join("libnixl.so"),
            true,
        )
        .unwrap();
        let report = lib.derivation.report();
        assert_eq!(
            lib.offsets.map(|o| o.counts),
            Some(counts),
            "{version}: {report}"
        );
        if counts != Counts::Always {
            assert!(
                report.contains("the same flag gates `getXferTelemetry+"),
                "{report}"
            );
        }
        let site = lib
            .derivation
            .telemetry_refused
            .as_ref()
            .unwrap_or_else(|e| panic!("{version}: {e}"));
        assert!(
            site.evidence
                .last()
                .unwrap()
                .ends_with("mov $0xfffffff4,%eax"),
            "{version}: {site:?}"
        );
        assert!(lib
            .probes
            .iter()
            .any(|p| p.spec.program == "xfer_telemetry_refused"));
        // postXferReq's status is final at one jump in every build: in r12 before 1.4,
        // r14 in 1.4, a frame slot from 1.5 on.
        let post = lib
            .derivation
            .post_site
            .as_ref()
            .unwrap_or_else(|why| panic!("{version}: {why}\n{report}"));
        let held = match version {
            "1.4.1" => offsets::SiteValue::Reg(offsets::SiteReg::R14),
            _ => offsets::SiteValue::Reg(offsets::SiteReg::R12),
        };
        assert_eq!(post.status, held, "{version}: {post:?}");
        assert!(lib.post_at_site && lib.creations_at_sites, "{version}");
        // createXferReq's and makeXferReq's failure paths: every build has both kinds
        // (before and after the request is built) and names each one's status.
        for (what, sites) in [
            ("createXferReq", &lib.derivation.create_sites),
            ("makeXferReq", &lib.derivation.make_sites),
        ] {
            let sites = sites
                .as_ref()
                .unwrap_or_else(|why| panic!("{version} {what}: {why}\n{report}"));
            assert!(sites.failed.len() >= 5, "{version} {what}: {sites:?}");
            assert!(
                sites.failed.iter().any(|f| f.request_built)
                    && sites.failed.iter().any(|f| !f.request_built),
                "{version} {what}: {sites:?}"
            );
        }
        assert!(lib
            .probes
            .iter()
            .all(|p| p.spec.program != "create_xfer_enter" && p.spec.program != "make_xfer_exit"));
        assert!(lib
            .probes
            .iter()
            .all(|p| p.spec.program != "post_xfer_exit"));
        // getXferStatus' ends: 1.4 on has a path for a success and one for a failure;
        // 1.0–1.3 merge a success with an in-progress answer when the agent's telemetry
        // is off, so their polls are probed (and the report says where).
        match (version, &lib.derivation.end_sites) {
            ("1.4.1", Ok(ends)) => {
                assert!(lib.sites, "{report}");
                assert_eq!(
                    (ends.succeeded.len(), ends.failed.len(), ends.stale.len()),
                    (1, 1, 1),
                    "{ends:?}"
                );
                assert_eq!(ends.stale_status, -4, "NIXL_ERR_NOT_FOUND");
                assert_eq!(ends.released_in_flight.len(), 1, "{ends:?}");
                assert!(!lib
                    .probes
                    .iter()
                    .any(|p| p.spec.program == "xfer_status_exit"
                        || p.spec.program == "release_xfer_enter"));
            }
            ("1.0.1" | "1.3.2", Err(why)) => {
                assert!(!lib.sites);
                assert!(why.contains("may still be success"), "{version}: {why}");
                assert!(lib
                    .probes
                    .iter()
                    .any(|p| p.spec.program == "xfer_status_exit"));
            }
            (_, found) => panic!("{version}: {found:?}\n{report}"),
        }
    }
}

/// The same wheels built for aarch64 (scripts/setup; `KVSCOPE_NIXL_AARCH64` names
/// others), derived offline from their own instructions: every field equal to the
/// x86-64 build's of that version (one struct layout), and when the requests hold their
/// byte counts too. The sites are x86-64's: none is placed on an aarch64 build.
#[test]
fn aarch64_builds_derive_the_x86_64_builds_layout() {
    use kvscope_agent::nixl::derive::Isa;
    let versions = std::env::var("KVSCOPE_NIXL_AARCH64")
        .unwrap_or_else(|_| "1.0.1 1.3.2 1.4.1 1.5.1".to_string());
    println!("| NIXL | aarch64 build | fields equal to x86-64's | byte counts |");
    println!("|---|---|---|---|");
    for version in versions.split_whitespace() {
        let a64 = NixlLibrary::inspect(&support::aarch64_nixl_lib(version), true).unwrap();
        let x86_lib = if version == kvscope_nixl_lab::libs::NIXL_VERSION {
            support::nixl_libs().libnixl
        } else {
            support::older_nixl_lib_dir(version).join("libnixl.so")
        };
        let x86 = NixlLibrary::inspect(&x86_lib, true).unwrap();
        assert_eq!(
            (a64.derivation.isa, x86.derivation.isa),
            (Isa::Aarch64, Isa::X86_64)
        );
        assert_ne!(a64.build_id, x86.build_id, "{version}: two builds");
        let report = a64.derivation.report();
        let a = a64
            .offsets
            .unwrap_or_else(|| panic!("{version} aarch64: {report}"));
        let x = x86.offsets.unwrap();
        assert_eq!(fields(&a), fields(&x), "{version}: {report}");
        assert_eq!(a.counts, x.counts, "{version}: {report}");
        // Derived from aarch64 instructions (AT&T x86 operands carry a `%`).
        assert!(
            a64.derivation
                .fields
                .iter()
                .all(|f| !f.evidence.is_empty() && f.evidence.iter().all(|e| !e.contains('%'))),
            "{report}"
        );
        assert!(!a64.sites && !a64.post_at_site && !a64.creations_at_sites);
        assert!(
            report.contains("no site is placed on an aarch64 build"),
            "{report}"
        );
        let counts = match a.counts {
            offsets::Counts::Always => "always".to_string(),
            offsets::Counts::WithTelemetry { data_flag } => {
                format!("with the agent's telemetry on (its byte {data_flag:#x})")
            }
            offsets::Counts::Never => "never".to_string(),
        };
        println!(
            "| {version} | {}… | 12 of 12 | {counts} |",
            &a64.build_id[..8]
        );
    }
}

#[test]
fn nixl_inspect_says_what_was_derived_and_from_which_instructions() {
    let libs = support::nixl_libs();
    let out = Command::new(kvscope_e2e::agent())
        .arg("nixl-inspect")
        .arg(&libs.libnixl)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("offsets        all derived"), "{text}");
    assert!(
        text.contains("ends           at the completion sites of getXferStatus"),
        "{text}"
    );
    assert!(
        text.contains("getXferStatus' completion sites (the request in Rbx)"),
        "{text}"
    );
    assert!(
        text.contains("creations      at the failure sites of createXferReq and makeXferReq")
            && text.contains("createXferReq fails at 8 sites")
            && text.contains("failed (Const(-4), request built)"),
        "{text}"
    );
    assert!(
        text.contains("posts          at the site where postXferReq's status is final")
            && text.contains("postXferReq's status is final at 0x")
            && text.contains("status: postXferReq+0x"),
        "{text}"
    );
    assert!(text.contains("req_bytes      0xd8"), "{text}");
    assert!(
        text.contains("getXferTelemetry+0x") && text.contains("postXferReq+0x"),
        "{text}"
    );

    // A file that is not a library: a clear error, no panic.
    let dir = tempfile::tempdir().unwrap();
    let not_elf = dir.path().join("libnixl.so");
    std::fs::write(&not_elf, b"#!/bin/sh\n").unwrap();
    let out = Command::new(kvscope_e2e::agent())
        .arg("nixl-inspect")
        .arg(&not_elf)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("not an ELF"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bad_libraries_are_refused_or_derived_in_part_with_the_reason() {
    let libs = support::nixl_libs();
    let whole = std::fs::read(&libs.libnixl).unwrap();
    let dir = tempfile::tempdir().unwrap();

    // Truncated anywhere: refused, or what is left derived in part; never a panic.
    for cut in [16, 4096, whole.len() / 3, whole.len() / 2, whole.len() - 1] {
        let path = dir.path().join(format!("cut-{cut}.so"));
        std::fs::write(&path, &whole[..cut]).unwrap();
        match NixlLibrary::inspect(&path, true) {
            Err(e) => assert!(!e.to_string().is_empty()),
            Ok(lib) => {
                if lib.offsets.is_none() {
                    assert!(lib.derivation.offsets().is_err());
                }
            }
        }
    }

    // Built for another machine (32-bit Arm in the ELF header): refused, naming it.
    let mut arm = whole.clone();
    arm[18..20].copy_from_slice(&40u16.to_le_bytes()); // e_machine = EM_ARM
    let path = dir.path().join("arm.so");
    std::fs::write(&path, &arm).unwrap();
    let why = NixlLibrary::inspect(&path, true).unwrap_err().to_string();
    assert!(why.contains("built for Arm"), "{why}");

    // No instruction names a descriptor's length: those fields are unknown and say
    // why; the rest are still derived; the offsets as a whole are not used.
    let copy = support::copy_libs_patched(&libs.lib_dir, dir.path(), &[support::DESCRIPTOR_SUM]);
    let lib = NixlLibrary::inspect(&copy.join("libnixl.so"), true).unwrap();
    assert!(lib.offsets.is_none() && !lib.sites);
    let why = lib.derivation.offsets().unwrap_err();
    assert!(why.contains("registerMem"), "{why}");
    let unknown: Vec<&str> = lib
        .derivation
        .fields
        .iter()
        .filter(|f| f.value.is_none())
        .map(|f| f.name)
        .collect();
    assert_eq!(unknown, ["dlist_begin", "desc_stride", "desc_len"]);

    // getXferStatus no longer tests for in progress where the walk looks: no end site
    // is placed, the reason is given, the offsets are still derived, and transfers'
    // ends are seen by the probes on every poll and release.
    let dir = tempfile::tempdir().unwrap();
    let copy = support::copy_libs_patched(
        &libs.lib_dir,
        dir.path(),
        &[support::STATUS_IN_PROGRESS_TEST],
    );
    let lib = NixlLibrary::inspect(&copy.join("libnixl.so"), true).unwrap();
    let why = lib.derivation.end_sites.clone().unwrap_err();
    assert!(why.contains("in-progress"), "{why}");
    assert!(lib.offsets.is_some() && !lib.sites);
    let programs: Vec<&str> = lib.probes.iter().map(|p| p.spec.program).collect();
    assert!(programs.contains(&"xfer_status_exit") && programs.contains(&"release_xfer_enter"));
    assert!(!programs.contains(&"xfer_status_changed"));
    assert!(
        lib.derivation
            .report()
            .contains("the completion sites were not found"),
        "{}",
        lib.derivation.report()
    );

    // postXferReq returns a constant, not a status kept where a site can read it: no
    // post site, the reason given, posts seen by the return probe; the rest derived.
    let dir = tempfile::tempdir().unwrap();
    let copy =
        support::copy_libs_patched(&libs.lib_dir, dir.path(), &[support::POST_STATUS_RETURN]);
    let lib = NixlLibrary::inspect(&copy.join("libnixl.so"), true).unwrap();
    let why = lib.derivation.post_site.clone().unwrap_err();
    assert!(
        why.contains("not in one callee-saved register or frame slot")
            && why.contains("xor %eax,%eax"),
        "{why}"
    );
    assert!(lib.offsets.is_some() && lib.sites && !lib.post_at_site);
    assert_eq!(lib.sites_attached().post_status, None);
    let programs: Vec<&str> = lib.probes.iter().map(|p| p.spec.program).collect();
    assert!(programs.contains(&"post_xfer_exit") && !programs.contains(&"post_xfer_returned"));
    assert!(lib
        .derivation
        .report()
        .contains("postXferReq is probed at its return"));

    // Two of createXferReq's failure paths return what a call left in eax: no sites can
    // see every failure, so creations are probed at the methods' entries and returns
    // (both methods: the group is attached whole or not at all), with the reason.
    let dir = tempfile::tempdir().unwrap();
    let copy =
        support::copy_libs_patched(&libs.lib_dir, dir.path(), &[support::CREATE_FAILURE_STATUS]);
    let lib = NixlLibrary::inspect(&copy.join("libnixl.so"), true).unwrap();
    let why = lib.derivation.create_sites.clone().unwrap_err();
    assert!(why.contains("no site sees"), "{why}");
    assert!(lib.derivation.make_sites.is_ok());
    assert!(lib.offsets.is_some() && lib.sites && lib.post_at_site && !lib.creations_at_sites);
    assert_eq!(lib.sites_attached().creations, None);
    let programs: Vec<&str> = lib.probes.iter().map(|p| p.spec.program).collect();
    assert!(programs.contains(&"create_xfer_enter") && programs.contains(&"make_xfer_exit"));
    assert!(!programs.contains(&"xfer_creation_failed"));
    assert!(lib
        .derivation
        .report()
        .contains("createXferReq is probed at its entry and return"));
}
