from http_api.service import main

main()
