//! Tests of `descriptor.rs`: round trips, every malformed input, versions, a bounded fuzz.
use super::*;

fn address() -> EngineAddress {
    EngineAddress {
        transport: "tcp;ofi_rxm".into(),
        domains: vec![vec![1, 2, 3, 4], vec![], vec![0xff; 40]],
        incarnation: 0x1877_5e0f_1234_abcd,
    }
}

fn descriptor() -> RegionDescriptor {
    RegionDescriptor {
        transport: "verbs".into(),
        len: 1 << 33,
        domains: vec![
            DomainKey { address: vec![9; 16], base: 0x7f00_dead_beef, key: 0x1234 },
            DomainKey { address: vec![], base: 0, key: u64::MAX },
        ],
        gpu: None,
        incarnation: 0x1877_5e0f_1234_abcd,
    }
}

fn gpu_descriptor() -> RegionDescriptor {
    RegionDescriptor {
        gpu: Some(GpuRegion {
            ordinal: 3,
            staged: true,
            ipc: Some(vec![0xab; IPC_EXPORT_LEN]),
            host: b"2f3c-boot".to_vec(),
        }),
        ..descriptor()
    }
}

fn malformed_reason(err: Error, expected_what: &str) -> String {
    match err {
        Error::Malformed { what, reason } => {
            assert_eq!(what, expected_what);
            reason
        }
        other => panic!("expected Malformed, got {other:?}"),
    }
}

#[test]
fn serde_traits_are_derived() {
    fn assert_serde<T: Serialize + for<'de> Deserialize<'de>>() {}
    assert_serde::<EngineAddress>();
    assert_serde::<RegionDescriptor>();
    assert_serde::<DomainKey>();
}

#[test]
fn round_trips() {
    let cases = [
        address(),
        EngineAddress { transport: String::new(), domains: vec![], incarnation: 0 },
        EngineAddress {
            transport: "x".repeat(MAX_TRANSPORT_LEN),
            domains: vec![vec![7; MAX_ADDRESS_LEN]; MAX_DOMAINS],
            incarnation: u64::MAX,
        },
    ];
    for a in cases {
        a.validate().unwrap();
        assert_eq!(EngineAddress::from_bytes(&a.to_bytes()).unwrap(), a);
    }
    let d = descriptor();
    d.validate().unwrap();
    assert_eq!(RegionDescriptor::from_bytes(&d.to_bytes()).unwrap(), d);
    let empty = RegionDescriptor {
        transport: "shm".into(),
        len: 0,
        domains: vec![],
        gpu: None,
        incarnation: u64::MAX,
    };
    assert_eq!(RegionDescriptor::from_bytes(&empty.to_bytes()).unwrap(), empty);
}

#[test]
fn encoding_is_compact_and_starts_with_magic() {
    let bytes = address().to_bytes();
    assert_eq!(&bytes[..5], b"FABA\x02");
    assert_eq!(bytes.len(), 5 + 2 + 11 + 2 + (4 + 4) + 4 + (4 + 40) + 8);
    let bytes = descriptor().to_bytes();
    assert_eq!(&bytes[..5], b"FABR\x03");
    assert_eq!(bytes.len(), 5 + 2 + 5 + 8 + 2 + (4 + 16 + 16) + (4 + 16) + 1 + 8);
    let bytes = gpu_descriptor().to_bytes();
    assert_eq!(bytes.len(), 5 + 2 + 5 + 8 + 2 + (4 + 16 + 16) + (4 + 16) + 1 + 4 + 1 + 80 + 1 + 9 + 8);
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = address().to_bytes();
    for n in 0..bytes.len() {
        let reason = malformed_reason(EngineAddress::from_bytes(&bytes[..n]).unwrap_err(), ADDRESS_WHAT);
        assert!(reason.contains("truncated"), "{n}: {reason}");
    }
    let bytes = descriptor().to_bytes();
    for n in 0..bytes.len() {
        let reason =
            malformed_reason(RegionDescriptor::from_bytes(&bytes[..n]).unwrap_err(), DESCRIPTOR_WHAT);
        assert!(reason.contains("truncated"), "{n}: {reason}");
    }
}

#[test]
fn trailing_bytes_are_an_error() {
    let mut bytes = descriptor().to_bytes();
    bytes.push(0);
    let reason = malformed_reason(RegionDescriptor::from_bytes(&bytes).unwrap_err(), DESCRIPTOR_WHAT);
    assert!(reason.contains("1 trailing byte"), "{reason}");
}

#[test]
fn bad_magic_and_version() {
    let mut bytes = address().to_bytes();
    bytes[0] = b'X';
    let reason = malformed_reason(EngineAddress::from_bytes(&bytes).unwrap_err(), ADDRESS_WHAT);
    assert!(reason.contains("bad magic"), "{reason}");

    let mut bytes = address().to_bytes();
    bytes[4] = 3;
    let reason = malformed_reason(EngineAddress::from_bytes(&bytes).unwrap_err(), ADDRESS_WHAT);
    assert!(reason.contains("unknown version 3"), "{reason}");

    let mut bytes = descriptor().to_bytes();
    bytes[4] = 0;
    let reason = malformed_reason(RegionDescriptor::from_bytes(&bytes).unwrap_err(), DESCRIPTOR_WHAT);
    assert!(reason.contains("unknown version 0"), "{reason}");
}

#[test]
fn mixing_up_address_and_descriptor_says_so() {
    let reason =
        malformed_reason(RegionDescriptor::from_bytes(&address().to_bytes()).unwrap_err(), DESCRIPTOR_WHAT);
    assert!(reason.contains("encoded engine address"), "{reason}");
    let reason =
        malformed_reason(EngineAddress::from_bytes(&descriptor().to_bytes()).unwrap_err(), ADDRESS_WHAT);
    assert!(reason.contains("encoded region descriptor"), "{reason}");
}

#[test]
fn absurd_lengths_are_rejected_before_reading() {
    // Domain count over the limit.
    let mut bytes = b"FABA\x01".to_vec();
    bytes.extend_from_slice(&0u16.to_le_bytes());
    bytes.extend_from_slice(&65u16.to_le_bytes());
    let reason = malformed_reason(EngineAddress::from_bytes(&bytes).unwrap_err(), ADDRESS_WHAT);
    assert!(reason.contains("domain count 65"), "{reason}");

    // Transport length over the limit.
    let mut bytes = b"FABR\x01".to_vec();
    bytes.extend_from_slice(&65u16.to_le_bytes());
    bytes.extend_from_slice(&[b'a'; 65]);
    let reason = malformed_reason(RegionDescriptor::from_bytes(&bytes).unwrap_err(), DESCRIPTOR_WHAT);
    assert!(reason.contains("transport name length 65"), "{reason}");

    // Address length u32::MAX: must not try to allocate or read 4 GiB.
    let mut bytes = b"FABA\x01".to_vec();
    bytes.extend_from_slice(&0u16.to_le_bytes());
    bytes.extend_from_slice(&1u16.to_le_bytes());
    bytes.extend_from_slice(&u32::MAX.to_le_bytes());
    let reason = malformed_reason(EngineAddress::from_bytes(&bytes).unwrap_err(), ADDRESS_WHAT);
    assert!(reason.contains("4294967295 bytes"), "{reason}");
}

#[test]
fn transport_must_be_utf8() {
    let mut bytes = b"FABA\x01".to_vec();
    bytes.extend_from_slice(&2u16.to_le_bytes());
    bytes.extend_from_slice(&[0xc3, 0x28]);
    bytes.extend_from_slice(&0u16.to_le_bytes());
    let reason = malformed_reason(EngineAddress::from_bytes(&bytes).unwrap_err(), ADDRESS_WHAT);
    assert!(reason.contains("not UTF-8"), "{reason}");
}

#[test]
fn values_over_the_limits_fail_validate_and_decode() {
    let too_many =
        EngineAddress { transport: "t".into(), domains: vec![vec![]; MAX_DOMAINS + 1], incarnation: 1 };
    assert!(matches!(too_many.validate(), Err(Error::Malformed { .. })));
    assert!(EngineAddress::from_bytes(&too_many.to_bytes()).is_err());

    let long_transport = RegionDescriptor {
        transport: "t".repeat(70_000),
        len: 1,
        domains: vec![],
        gpu: None,
        incarnation: 1,
    };
    assert!(matches!(long_transport.validate(), Err(Error::Malformed { .. })));
    assert!(RegionDescriptor::from_bytes(&long_transport.to_bytes()).is_err());

    let long_address = RegionDescriptor {
        transport: "t".into(),
        len: 1,
        domains: vec![DomainKey { address: vec![0; MAX_ADDRESS_LEN + 1], base: 0, key: 0 }],
        gpu: None,
        incarnation: 1,
    };
    assert!(matches!(long_address.validate(), Err(Error::Malformed { .. })));
    assert!(RegionDescriptor::from_bytes(&long_address.to_bytes()).is_err());
}

#[test]
fn check_transport_and_domains() {
    let d = descriptor();
    d.check_transport("verbs").unwrap();
    match d.check_transport("tcp;ofi_rxm").unwrap_err() {
        Error::Foreign { what, found, expected } => {
            assert_eq!(what, DESCRIPTOR_WHAT);
            assert_eq!(found, "verbs");
            assert_eq!(expected, "tcp;ofi_rxm");
        }
        other => panic!("{other:?}"),
    }
    let a = address();
    a.check_transport("tcp;ofi_rxm").unwrap();
    assert!(matches!(a.check_transport("verbs"), Err(Error::Foreign { what: ADDRESS_WHAT, .. })));

    d.check_domains(2).unwrap();
    match d.check_domains(4).unwrap_err() {
        Error::Foreign { what, found, expected } => {
            assert_eq!(what, DESCRIPTOR_WHAT);
            assert_eq!(found, "verbs with 2 domain(s)");
            assert_eq!(expected, "verbs with 4 domain(s)");
        }
        other => panic!("{other:?}"),
    }
}

use super::super::test_rng::Rng;

/// Decodes `input` both ways; whatever is accepted must re-encode to the same bytes.
fn check_input(input: &[u8]) -> usize {
    let mut accepted = 0;
    if let Ok(a) = EngineAddress::from_bytes(input) {
        // Version 1 input reads with incarnation 0 and re-encodes as version 1.
        assert_eq!(a.encode(input[4]), input);
        if input[4] == 1 {
            assert_eq!(a.incarnation, 0);
        }
        accepted += 1;
    }
    if let Ok(d) = RegionDescriptor::from_bytes(input) {
        // Versions 1 and 2 read with incarnation 0 (version 1 as host memory) and re-encode
        // as themselves.
        let version = input[4];
        assert_eq!(d.encode(version), input);
        if version == 1 {
            assert!(d.gpu.is_none());
        }
        if version < 3 {
            assert_eq!(d.incarnation, 0);
        }
        accepted += 1;
    }
    accepted
}

#[test]
fn gpu_descriptors_round_trip_and_version_1_still_reads() {
    for d in [
        gpu_descriptor(),
        RegionDescriptor {
            gpu: Some(GpuRegion { ordinal: 0, staged: false, ipc: None, host: vec![] }),
            ..descriptor()
        },
    ] {
        d.validate().unwrap();
        assert_eq!(RegionDescriptor::from_bytes(&d.to_bytes()).unwrap(), d);
        assert_eq!(
            d.location(),
            crate::provider::MemoryLocation::Cuda { ordinal: d.gpu.as_ref().unwrap().ordinal }
        );
    }
    // An older build's descriptor (version 1, no location) reads as host memory.
    let v1 = descriptor().encode(1);
    assert_eq!(&v1[..5], b"FABR\x01");
    let d = RegionDescriptor::from_bytes(&v1).unwrap();
    assert_eq!(d, RegionDescriptor { incarnation: 0, ..descriptor() });
    assert_eq!(d.location(), crate::provider::MemoryLocation::Host);
    // Version 2 (no incarnation) reads too, with incarnation 0 (unknown).
    let v2 = gpu_descriptor().encode(2);
    assert_eq!(
        RegionDescriptor::from_bytes(&v2).unwrap(),
        RegionDescriptor { incarnation: 0, ..gpu_descriptor() }
    );
    // And a version 1 engine address.
    let a1 = address().encode(1);
    assert_eq!(&a1[..5], b"FABA\x01");
    assert_eq!(EngineAddress::from_bytes(&a1).unwrap(), EngineAddress { incarnation: 0, ..address() });
    // Every truncation of a GPU descriptor is an error.
    let bytes = gpu_descriptor().to_bytes();
    for n in 0..bytes.len() {
        let reason =
            malformed_reason(RegionDescriptor::from_bytes(&bytes[..n]).unwrap_err(), DESCRIPTOR_WHAT);
        assert!(reason.contains("truncated"), "{n}: {reason}");
    }
}

#[test]
fn bad_gpu_fields_are_malformed() {
    let plain = descriptor().to_bytes();
    let loc = plain.len() - 1 - 8; // the location byte, before the incarnation
    let mut b = plain.clone();
    b[loc] = 7;
    assert!(malformed_reason(RegionDescriptor::from_bytes(&b).unwrap_err(), DESCRIPTOR_WHAT)
        .contains("unknown location 7"));
    let mut b = gpu_descriptor().to_bytes();
    b[loc + 5] |= 0x80;
    assert!(malformed_reason(RegionDescriptor::from_bytes(&b).unwrap_err(), DESCRIPTOR_WHAT)
        .contains("unknown GPU flags"));
    let mut b = gpu_descriptor().to_bytes();
    b[loc + 6 + 80] = 200;
    assert!(malformed_reason(RegionDescriptor::from_bytes(&b).unwrap_err(), DESCRIPTOR_WHAT)
        .contains("host id length 200"));
    let long_host = RegionDescriptor {
        gpu: Some(GpuRegion { ordinal: 0, staged: true, ipc: None, host: vec![1; MAX_HOST_ID_LEN + 1] }),
        ..descriptor()
    };
    assert!(long_host.validate().is_err());
    assert!(RegionDescriptor::from_bytes(&long_host.to_bytes()).is_err());
    let short_ipc = RegionDescriptor {
        gpu: Some(GpuRegion { ordinal: 0, staged: true, ipc: Some(vec![1; 3]), host: vec![] }),
        ..descriptor()
    };
    assert!(short_ipc.validate().is_err());
    assert!(RegionDescriptor::from_bytes(&short_ipc.to_bytes()).is_err());
}

/// 100,000 inputs, each through both decoders.
#[test]
fn fuzz_never_panics() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let seeds = [
        address().to_bytes(),
        address().encode(1),
        descriptor().to_bytes(),
        gpu_descriptor().to_bytes(),
        gpu_descriptor().encode(2),
    ];
    let mut accepted = 0;
    let mut input = Vec::new();
    for i in 0..100_000 {
        input.clear();
        match i % 4 {
            // Pure noise.
            0 => {
                let len = rng.below(128);
                input.extend((0..len).map(|_| rng.next() as u8));
            }
            // A valid header, then noise: exercises the length checks.
            1 => {
                let header: &[u8] = match rng.below(5) {
                    0 => b"FABA\x01",
                    1 => b"FABA\x02",
                    2 => b"FABR\x01",
                    3 => b"FABR\x02",
                    _ => b"FABR\x03",
                };
                input.extend_from_slice(header);
                let len = rng.below(128);
                input.extend((0..len).map(|_| rng.next() as u8));
            }
            // A valid encoding with a few bytes replaced or bits flipped, then cut or extended.
            _ => {
                let seed = &seeds[rng.below(seeds.len())];
                rng.mutate(seed, &mut input);
            }
        }
        accepted += check_input(&input);
    }
    // Some mutations (of base, key, address bytes) stay valid; make sure the loop reached them.
    assert!(accepted > 0);
}

#[test]
fn a_narrowed_descriptor_names_its_range_alone() {
    let d = descriptor();
    let n = d.narrow(4096, 200).unwrap();
    assert_eq!(n.len, 200);
    assert_eq!(n.domains[0].base, 0x7f00_dead_beef + 4096);
    assert_eq!(n.domains[1].base, 4096);
    assert_eq!((n.domains[0].key, n.domains[1].key), (0x1234, u64::MAX));
    assert_eq!((&n.transport, n.incarnation, &n.gpu), (&d.transport, d.incarnation, &None));
    assert_eq!(RegionDescriptor::from_bytes(&n.to_bytes()).unwrap(), n);
    // The whole region, and a range that ends at its end.
    assert_eq!(d.narrow(0, d.len).unwrap(), d);
    assert_eq!(d.narrow(d.len - 1, 1).unwrap().len, 1);
    for (off, len) in [(0, 0), (d.len, 1), (d.len - 1, 2), (u64::MAX, 2)] {
        assert!(matches!(d.narrow(off, len), Err(Error::OutOfBounds { .. })), "{off} {len}");
    }
    // The base would overflow: malformed, not wrapped.
    let mut high = descriptor();
    high.domains[0].base = u64::MAX - 10;
    assert!(matches!(high.narrow(100, 1), Err(Error::Malformed { .. })));
    assert!(matches!(gpu_descriptor().narrow(0, 1), Err(Error::Unsupported(_))));
}
